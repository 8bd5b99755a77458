"""`adaptspec models pull|list`."""
from __future__ import annotations

import typer

from adaptspec.clierr import fail_cleanly, console as _console


def register(app: typer.Typer) -> None:
    models = typer.Typer(help="Pull and list models (built-in aliases, local folders, .gguf files).",
                         no_args_is_help=True)

    @models.command("pull")
    @fail_cleanly
    def pull_cmd(name: str = typer.Argument(..., help="built-in alias, e.g. smollm2-135m"),
                 force: bool = typer.Option(False, help="pull again even when cached")) -> None:
        """Download, verify and convert a built-in model into the cache."""
        from adaptspec.models.pull import pull

        pull(name, force=force)

    @models.command("list")
    def list_cmd() -> None:
        """Show built-in aliases and what is cached under $ADAPTSPEC_HOME."""
        from rich.table import Table

        from adaptspec.models.registry import BUILTIN, alias_dir, home, is_complete, list_cached

        table = Table(title=f"models (cache root {home()})")
        for col in ("name", "cached", "size", "description / path"):
            table.add_column(col)
        sizes = {name: (folder, size) for name, folder, size in list_cached()}
        for alias, spec in BUILTIN.items():
            if spec.packaged:  # ships inside the package: always there
                from adaptspec.models.registry import packaged_dir

                folder = packaged_dir(alias)
                size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
                table.add_row(alias, "packaged", f"{size / 1e6:.0f} MB", spec.description)
                continue
            cached = alias in sizes and is_complete(alias_dir(alias))
            size = f"{sizes[alias][1] / 1e6:.0f} MB" if cached else ""
            table.add_row(alias, "yes" if cached else "no", size, spec.description)
        for name, (folder, size) in sizes.items():
            if name not in BUILTIN:
                table.add_row(name, "yes", f"{size / 1e6:.0f} MB", str(folder))
        _console().print(table)

    app.add_typer(models, name="models")
