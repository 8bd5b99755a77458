"""AdaptSpec: adaptive speculative decoding.

``Engine``, ``SamplingParams`` and ``SpecConfig`` are loaded lazily so that the
controller and simulator (``adaptspec.control``, ``adaptspec.sim``) import without torch.
"""
from __future__ import annotations

import json
from importlib import resources

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "SpecConfig", "bench_prompts"]


def bench_prompts() -> dict[str, list[str]]:
    """The shipped prompt set, {class: [prompt]}: what `adaptspec bench` and the load test send
    by default, and what the distillation corpus holds out."""
    return json.loads(resources.files("adaptspec").joinpath("data/bench_prompts.json").read_text())


def __getattr__(name: str):
    if name == "Engine":
        from adaptspec.engine.engine import Engine

        return Engine
    if name in ("SamplingParams", "SpecConfig"):
        from adaptspec.engine import params

        return getattr(params, name)
    raise AttributeError(f"module 'adaptspec' has no attribute {name!r}")
