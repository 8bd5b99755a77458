"""CLI commands of the simulator area (`simulate`, `calibrate`)."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this area's commands to the main app."""
