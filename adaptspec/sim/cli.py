"""CLI commands of the simulator area (`simulate`, `calibrate`, `speed-probe`)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from adaptspec.clierr import console as _console


def register(app: typer.Typer) -> None:
    """Add this area's commands to the main app."""

    @app.command()
    def simulate(
        scenario: Path = typer.Argument(..., help="scenario YAML"),
        policy: Optional[List[str]] = typer.Option(None, "--policy", "-p", help="run only these policies (labels)"),
        seed: Optional[int] = typer.Option(None, "--seed", help="override the scenario's seed"),
        json_path: Optional[Path] = typer.Option(None, "--json",
                                                 help="write all metrics as JSON (gzipped where the name ends in .gz)"),
        plot_dir: Optional[Path] = typer.Option(None, "--plot", help="write PNG plots into this folder"),
        per_class: bool = typer.Option(True, help="also print the per-class table"),
    ) -> None:
        """Run a scenario against its policies; print a table per policy."""
        import time

        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.table import Table

        from adaptspec.sim.report import class_rows, plot, table_rows, write_json
        from adaptspec.sim.runner import run_scenario
        from adaptspec.sim.scenario import load_scenario

        console = _console()
        try:
            sc, base = load_scenario(scenario)
        except (ValueError, OSError) as e:
            console.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2)
        t0 = time.perf_counter()
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                      TimeElapsedColumn(), console=console, transient=True) as bar:
            task = bar.add_task("simulating", total=1.0)

            def progress(label: str, f: float) -> None:
                bar.update(task, description=f"{sc.name}: {label}", completed=f)

            try:
                result = run_scenario(sc, base, only=policy or None, seed=seed, progress=progress)
            except ValueError as e:
                console.print(f"[red]error:[/red] {e}")
                raise typer.Exit(2)
        wall = time.perf_counter() - t0
        for head, rows, title in ((*table_rows(result.runs), sc.name), (*class_rows(result.runs), "per class")):
            if title == "per class" and not per_class:
                continue
            t = Table(title=title)
            for h in head:
                t.add_column(h)
            for r in rows:
                t.add_row(*r)
            console.print(t)
        sim_s = sum(r.simulated_s for r in result.runs)
        run_wall = sum(r.wall_s for r in result.runs)
        console.print(f"{len(result.runs)} runs, {sim_s:.0f} simulated s in {run_wall:.1f} s of simulation "
                      f"({wall:.1f} s wall in all); decisions: "
                      + ", ".join(f"{r.policy} {r.decision_us_mean:.1f} us" for r in result.runs[: len(set(x.policy for x in result.runs))]))
        for label, note in result.policy_notes.items():
            console.print(f"  targets - {label}: {note}")
        if json_path:
            write_json(result, json_path)
            console.print(f"wrote {json_path}")
        if plot_dir:
            for p in plot(result, plot_dir):
                console.print(f"wrote {p}")

    @app.command()
    def calibrate(
        out: Path = typer.Option(Path("cpu-profile.json"), "--out", help="profile JSON to write"),
        target: str = typer.Option("smollm2-135m", help="target model spec"),
        draft: Optional[str] = typer.Option(None, help="draft model spec"),
        dtype: str = typer.Option("bf16", help="dtype"),
        device: str = typer.Option("cpu", help="device"),
        repeats: int = typer.Option(3, help="timed decode steps per (batch size, arm)"),
        batch: str = typer.Option("1,2,4,8,16", help="batch sizes to measure, comma-separated"),
        ks: str = typer.Option("2,4,8", help="k values to measure, comma-separated"),
        passes: int = typer.Option(2, help="times the grid is measured, every other pass in reverse order "
                                           "(the machine's speed drifts during a calibration: pooled passes "
                                           "spread the drift over every point instead of bending the table)"),
        warmup: bool = typer.Option(True, "--warmup/--no-warmup",
                                    help="one untimed pass over the grid first: on the CPU a step of a shape "
                                         "not met before pays one-off kernel set-up (see calibrate)"),
        context_term: bool = typer.Option(True, "--context-term/--no-context-term",
                                          help="fit verify time per KV token read as well, from points measured at "
                                               "several contexts (off: a table over verify tokens alone, see "
                                               "fit_profile)"),
        prompt_tokens: str = typer.Option("32,160", help="prompt lengths of the decode points' requests, "
                                                         "comma-separated, taken in turn (two or more: each point "
                                                         "meets several contexts, which prices the context)"),
        prompt_lengths: str = typer.Option("8,16,32,64,128", help="prompt lengths of one-request prompt passes, "
                                           "comma-separated: the profile's prompt table (prompt tokens priced apart "
                                           "from verified ones, see control.costs); empty: none"),
        from_steps: Optional[Path] = typer.Option(None, help="measure nothing: fit the profile again from a "
                                                             "calibration's raw steps (<profile>.steps.csv), with "
                                                             "the limits of the profile beside it"),
        config: Optional[str] = typer.Option(None, help="service config YAML: measure the engine it builds (its "
                                                         "models, dtype, device, torch threads, engine limits) as "
                                                         "`adaptspec fidelity` does, the profile a `loadtest` of "
                                                         "that config should name as controller.cost_profile; "
                                                         "--target/--draft/--dtype/--device and the grid then "
                                                         "come from it and the fidelity run's defaults"),
        threads: Optional[int] = typer.Option(None, help="torch threads with --config (default: the config's)"),
    ) -> None:
        """Measure this machine's step costs with the live engine; write a profile JSON."""
        from adaptspec.sim.calibrate import calibrate as run, refit

        if threads is not None and (config is None or threads < 1):
            typer.echo("error: --threads: a positive count, with --config" if config else
                       "error: --threads needs --config (without it torch keeps its default)", err=True)
            raise typer.Exit(2)
        if config is not None:
            from adaptspec.serve.config import load_config
            from adaptspec.sim.fidelity_run import FidelityOptions, calibrate_for

            try:
                path = calibrate_for(load_config(config), out, FidelityOptions(torch_threads=threads))
            except (OSError, RuntimeError, ValueError) as e:
                typer.echo(f"error: {e}", err=True)
                raise typer.Exit(2)
            typer.echo(f"wrote {path}")
            return

        if from_steps is not None:
            if not Path(from_steps).is_file():
                typer.echo(f"error: --from-steps: {from_steps} is not a file", err=True)
                raise typer.Exit(2)
            like = Path(str(from_steps).removesuffix(".steps.csv") + ".json")
            path = refit(from_steps, out, like=like if like.is_file() else None, context_term=context_term)
            typer.echo(f"wrote {path}")
            return
        try:
            try:
                contexts = tuple(int(x) for x in prompt_tokens.split(",") if x.strip())
            except ValueError:
                raise ValueError(f"--prompt-tokens: integers, comma-separated, got {prompt_tokens!r}") from None
            path = run(out, target=target, draft=draft, dtype=dtype, device=device, repeats=repeats,
                       batch_sizes=tuple(int(x) for x in batch.split(",")), ks=tuple(int(x) for x in ks.split(",")),
                       context_term=context_term, passes=passes, prompt_tokens=contexts,
                       prefill=bool(prompt_lengths.strip()),
                       prompt_lengths=tuple(int(x) for x in prompt_lengths.split(",") if x.strip()), warmup=warmup)
        except (RuntimeError, ValueError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2)
        typer.echo(f"wrote {path}")

    @app.command("speed-probe")
    def speed_probe_cmd(
        config: Optional[str] = typer.Option(None, help="service config YAML (the engine it builds); "
                                                         "default: the embedded one"),
        seconds: float = typer.Option(45.0, help="how long to probe, back to back"),
        threads: Optional[int] = typer.Option(None, help="torch threads (default: the config's)"),
        batch: str = typer.Option("1,8", help="batch sizes of each probe, comma-separated"),
        steps: int = typer.Option(10, help="timed decode steps per probe and batch size"),
        json_path: Optional[Path] = typer.Option(None, "--json", help="write every reading and the summary here"),
    ) -> None:
        """How repeatable this machine is: the same decode-step probe of an idle engine, back to
        back; per batch size the median, range and coefficient of variation of a step."""
        import json
        import time

        from rich.table import Table

        try:
            sizes = tuple(int(x) for x in batch.split(",") if x.strip())
        except ValueError:
            sizes = ()
        for bad, msg in ((not seconds > 0, f"--seconds must be > 0, got {seconds}"),
                         (steps < 1, f"--steps must be >= 1, got {steps}"),
                         (threads is not None and threads < 1, f"--threads must be >= 1, got {threads}"),
                         (not sizes or min(sizes) < 1, f"--batch must be positive integers, got {batch!r}")):
            if bad:
                typer.echo(f"error: {msg}", err=True)
                raise typer.Exit(2)
        import torch

        from adaptspec.serve.config import load_config
        from adaptspec.serve.engine_proc import build_engine
        from adaptspec.sim.speed_probe import repeatability, speed_probe

        engine = build_engine(load_config(config), torch_threads=threads)
        speed_probe(engine, sizes, steps)  # untimed: a fresh engine's first passes are slow
        t0, readings = time.perf_counter(), []
        while time.perf_counter() - t0 < seconds:
            readings.append(speed_probe(engine, sizes, steps))
        stats = repeatability(readings)
        t = Table(title=f"decode step, {len(readings)} probes in {seconds:g} s, {torch.get_num_threads()} torch threads")
        for c in ("batch", "median ms", "min ms", "max ms", "CV"):
            t.add_column(c)
        for b, r in stats.items():
            t.add_row(str(b), f"{1e3 * r['median_s']:.2f}", f"{1e3 * r['min_s']:.2f}", f"{1e3 * r['max_s']:.2f}",
                      f"{r['cv']:.3f}")
        out = _console()
        out.print(t)
        if json_path:
            json_path.write_text(json.dumps({"threads": torch.get_num_threads(), "seconds": seconds,
                                             "summary": {str(b): r for b, r in stats.items()},
                                             "readings": [{str(b): v for b, v in r.items()} for r in readings]},
                                            indent=1))
            out.print(f"wrote {json_path}")
