"""The `adaptspec` command line: one typer app.

Each area registers its own commands (``register(app)``) so that modules stay small and
heavy imports (torch, transformers, ray) happen inside the command, not at start-up.
"""
from __future__ import annotations

import typer

app = typer.Typer(
    name="adaptspec",
    help="Adaptive speculative decoding: engine, controller, simulator and service.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _register_all() -> None:
    from adaptspec.models.cli import register as register_models
    from adaptspec.engine.cli import register as register_engine
    from adaptspec.sim.cli import register as register_sim
    from adaptspec.serve.cli import register as register_serve
    from adaptspec.distill.cli import register as register_distill
    from adaptspec.sim.fidelity_cli import register as register_fidelity
    from adaptspec.tools.engine_ab import register as register_ab
    from adaptspec.tools.prefix_bench import register as register_prefix
    from adaptspec.tools.demo import register as register_demo

    register_models(app)
    register_engine(app)
    register_sim(app)
    register_serve(app)
    register_distill(app)
    register_fidelity(app)
    register_ab(app)
    register_prefix(app)
    register_demo(app)


_register_all()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
