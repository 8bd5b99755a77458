"""CLI commands of the engine area (`complete`, `bench`, `demo`)."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this area's commands to the main app."""
