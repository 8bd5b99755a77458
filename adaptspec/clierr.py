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


def console(stderr: bool = False):
    """A rich console for the commands' tables and progress. Where the output is not a
    terminal (a log file, a pipe, CI) and ``COLUMNS`` is unset, 140 columns rather than rich's
    80, so that tables reach a log whole instead of with truncated headers."""
    import os

    from rich.console import Console

    con = Console(stderr=stderr)
    if not con.is_terminal and "COLUMNS" not in os.environ:
        con = Console(stderr=stderr, width=140)
    return con
