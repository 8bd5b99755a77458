"""One-line errors for the CLI: bad input and unreachable hubs never print a stack trace."""
from __future__ import annotations

import functools
import sys

import typer


def fail_cleanly(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from adaptspec.models.registry import HubUnreachableError

        try:
            return fn(*args, **kwargs)
        except (ValueError, HubUnreachableError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise typer.Exit(2) from None

    return wrapper
