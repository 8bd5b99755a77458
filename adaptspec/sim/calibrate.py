"""``adaptspec calibrate``: measure step costs of the live engine, write a profile JSON.

Imports the engine (torch) inside the function only; the simulator itself never does.
"""
from __future__ import annotations

from pathlib import Path


def calibrate(out: Path, *, target: str, draft: str | None, dtype: str, device: str, repeats: int) -> Path:
    try:
        from adaptspec import Engine  # noqa: F401  (torch)
    except Exception as e:  # pragma: no cover - depends on the install
        raise RuntimeError(f"calibrate needs the engine (torch): {e}") from None
    raise RuntimeError("calibrate is not implemented yet")
