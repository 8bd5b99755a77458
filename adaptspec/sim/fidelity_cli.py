"""The `fidelity` command: the same workload live and simulated, within how much?"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from adaptspec.clierr import console as _console, fail_cleanly


def register(app: typer.Typer) -> None:
    app.command("fidelity")(fidelity)


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        xs = tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        xs = ()
    if not xs or any(x < 1 for x in xs):
        raise ValueError(f"{option}: positive integers, comma-separated, got {text!r}")
    return xs


@fail_cleanly
def fidelity(
    config: Optional[str] = typer.Option(None, help="service config YAML (models, engine, controller); default: "
                                                    "the embedded one"),
    out: Path = typer.Option(Path("fidelity"), "--out", help="folder for the report (fidelity.json, fidelity.png, "
                                                             "step_shapes.md) and what it used (profile, "
                                                             "acceptance, prompt set, scenario)"),
    concurrency: str = typer.Option("1,4,16", help="closed-loop client counts (comma-separated; empty: none)"),
    rate: str = typer.Option("", help="open-loop arrival rates, requests/s (comma-separated)"),
    arrival: str = typer.Option("poisson", help="open-loop inter-arrival law: poisson | gamma"),
    burstiness: float = typer.Option(1.0, help="gamma shape (< 1: burstier)"),
    think_time: float = typer.Option(0.0, help="closed loop: mean seconds between a reply and the next request"),
    think: str = typer.Option("fixed", help="think-time law: fixed | exponential"),
    arrival_seed: int = typer.Option(0, help="seed of the arrival and think times"),
    policies: str = typer.Option("", help="comma-separated policies (default: thompson, static:none:0 and each "
                                          "drafter at k = 4)"),
    classes: str = typer.Option("chat,code_edit,extraction", help="request classes, sent in turn"),
    duration: float = typer.Option(30.0, help="measured seconds per level and policy"),
    warmup: float = typer.Option(10.0, help="seconds of load before each measured window"),
    rounds: int = typer.Option(1, help="live runs per level and policy, interleaved"),
    fresh: bool = typer.Option(False, "--fresh", help="start each run's policy afresh (live and simulated)"),
    max_tokens: int = typer.Option(64, help="max_tokens of every request"),
    prompts: Optional[str] = typer.Option(None, help="the requests' prompts, as loadtest's --prompts: "
                                                     "corpus:N[:SEED] or a JSON file {class: [prompt, ...]}; default: "
                                                     "the bench prompts (the folder keeps them as sent: prompts.json)"),
    profile: Optional[str] = typer.Option(None, help="use this step-cost profile JSON instead of calibrating "
                                                     "(with --resimulate: instead of the run's)"),
    calibrate_repeats: int = typer.Option(3, help="timed steps per calibration point"),
    calibrate_batch: str = typer.Option("1,2,4,8,16", help="calibration batch sizes (up to the engine's KV slots)"),
    calibrate_ks: str = typer.Option("2,4,8", help="calibration k values"),
    calibrate_prompt_tokens: str = typer.Option("32,160", help="calibration prompt lengths, taken in turn by its "
                                                               "points (two or more: each point at several contexts "
                                                               "prices the context apart from the tokens; one: "
                                                               "the token table alone)"),
    sim_seeds: int = typer.Option(1, help="simulated runs per level and policy (pooled)"),
    grpc: bool = typer.Option(False, "--grpc", help="also run the levels through Ray Serve and gRPC (starts the "
                                                    "service of --config, one replica, which logs its engine's "
                                                    "steps for this run; the path is simulated on its own)"),
    torch_threads: Optional[int] = typer.Option(None, help="torch threads (default: the replica's)"),
    host_gap: bool = typer.Option(True, "--host-gap/--no-host-gap",
                                  help="simulate the host's time between engine steps as measured live"),
    snapshots: bool = typer.Option(True, "--snapshots/--no-snapshots",
                                   help="simulated policies hand out arms by snapshot, refreshed every "
                                        "controller.report_interval_s as a live replica's (no: every step)"),
    probe: bool = typer.Option(True, "--probe/--no-probe",
                               help="speed-probe the live engine right before and after every run and simulate "
                                    "the run on the profile's time costs times live probe / calibration probe "
                                    "(the machine's speed drifts between minutes), its prompt table times its own "
                                    "prompt probe / the table; with --resimulate: use the probes on file"),
    probe_tolerance: float = typer.Option(0.1, help="with --probe: a run whose speed (or prompt) probes before and "
                                                    "after it differ by more than this, relative, is simulated "
                                                    "without its factor (the probes cannot tell that minute's speed; "
                                                    "inf: trust every probe)"),
    speed_from: str = typer.Option("probes", help="each run's speed against the calibration: probes (timed "
                                                  "right before and after it, see --probe), steps (its own engine "
                                                  "steps priced on the profile: checks the model, not the "
                                                  "calibration's speed) or none (the calibration's speed)"),
    path_delay: bool = typer.Option(True, "--path-delay/--no-path-delay",
                                    help="add each level's median TTFT outside the engine, measured live through "
                                         "the service (client TTFT less the engine's), to that path's simulated "
                                         "token times"),
    prompt_probe: bool = typer.Option(True, "--prompt-probe/--no-prompt-probe",
                                      help="with --probe: also time prompt passes around every run and price the "
                                           "run's at its own factor (no: prompt passes at the run's speed factor; "
                                           "with --resimulate: ignore the prompt probes on file)"),
    per_prompt: bool = typer.Option(True, "--per-prompt/--no-per-prompt",
                                    help="replay each simulated request's acceptance from its prompt's own live "
                                         "counts where there are enough (no: every request from its class's)"),
    per_position: bool = typer.Option(True, "--per-position/--no-per-position",
                                      help="with --per-prompt: replay a simulated request's step at an output "
                                           "position its prompt's live runs settled (greedy: the same candidates "
                                           "kept) as it went live, and draw the rest (no: draw every step)"),
    cache_replay: bool = typer.Option(True, "--cache-replay/--no-cache-replay",
                                      help="simulate each run's prompts less the prompt tokens the prefix cache "
                                           "served its live run (no: every run less each prompt's median over all "
                                           "runs; the simulator has no prefix cache)"),
    median: str = typer.Option("hd", help="how a cell's TTFT and TPOT p50 are estimated: hd (Harrell-Davis, a "
                                          "weighted mean of every order statistic; steady where a class's prompts "
                                          "run at two speeds) or sample (the middle value); the other is reported "
                                          "beside it"),
    resimulate: Optional[Path] = typer.Option(None, help="a folder a fidelity run wrote: simulate its live runs "
                                                         "again (a changed simulator) and report into --out; "
                                                         "runs nothing live (level and policy options are "
                                                         "taken from that run)"),
) -> None:
    """Run one workload live and simulated; per class and level, the relative error of
    throughput, TTFT and TPOT p50/p99, and the arms chosen (a table, JSON and a plot)."""
    from adaptspec.serve.cli import load_levels
    from adaptspec.sim.fidelity import MEDIANS
    from adaptspec.sim.fidelity_run import SPEED_FROM, FidelityOptions, resimulate as resim, run_fidelity

    console = _console()
    if not probe_tolerance >= 0:
        raise ValueError(f"--probe-tolerance: must be >= 0 (inf: trust every probe), got {probe_tolerance}")
    if speed_from not in SPEED_FROM:
        raise ValueError(f"--speed-from: one of {', '.join(SPEED_FROM)}, got {speed_from!r}")
    if median not in MEDIANS:
        raise ValueError(f"--median: one of {', '.join(MEDIANS)}, got {median!r}")
    if resimulate is not None:
        if profile and not Path(profile).is_file():
            raise ValueError(f"--profile: {profile} is not a file")
        if Path(resimulate).resolve() == Path(out).resolve():
            raise ValueError("--out: give another folder than --resimulate (its report stays as it was measured)")
        cells, goal_list, meta = resim(resimulate, out, console, config=config, host_gap=host_gap,
                                       snapshots=snapshots, sim_seeds=sim_seeds if sim_seeds > 1 else None,
                                       profile=profile, probe=probe, prompt_probe=prompt_probe,
                                       cache_replay=cache_replay, per_prompt=per_prompt,
                                       per_position=per_position, probe_tolerance=probe_tolerance,
                                       path_delay=path_delay, speed_from=speed_from, median=median)
        _report(console, cells, goal_list, meta, out)
        return
    levels = load_levels(concurrency, "", think_time=think_time, think=think, seed=arrival_seed) if concurrency else []
    if rate:
        levels += load_levels("1", rate, arrival, burstiness, seed=arrival_seed)
    if not levels:
        raise ValueError("--concurrency / --rate: give at least one level")
    if rounds < 1 or sim_seeds < 1 or duration <= 0 or warmup < 0 or max_tokens < 1:
        raise ValueError("--rounds, --sim-seeds and --max-tokens must be >= 1, --duration > 0, --warmup >= 0")
    opts = FidelityOptions(config=config, levels=levels, policies=[p for p in policies.split(",") if p],
                           classes=[c for c in classes.split(",") if c], max_tokens=max_tokens, prompts=prompts,
                           duration_s=duration, warmup_s=warmup, rounds=rounds, fresh=fresh, profile=profile,
                           calibrate_repeats=calibrate_repeats,
                           calibrate_batch=_ints(calibrate_batch, "--calibrate-batch"),
                           calibrate_ks=_ints(calibrate_ks, "--calibrate-ks"),
                           calibrate_prompt_tokens=_ints(calibrate_prompt_tokens, "--calibrate-prompt-tokens"),
                           sim_seeds=sim_seeds, grpc=grpc,
                           torch_threads=torch_threads, host_gap=host_gap, snapshots=snapshots, probe=probe,
                           prompt_probe=prompt_probe, cache_replay=cache_replay, per_prompt=per_prompt,
                           per_position=per_position, probe_tolerance=probe_tolerance, path_delay=path_delay,
                           speed_from=speed_from, median=median, out=out)
    if not opts.classes:
        raise ValueError("--classes: at least one class")
    if profile and not Path(profile).is_file():
        raise ValueError(f"--profile: {profile} is not a file")
    cells, goal_list, meta = run_fidelity(opts, console)
    _report(console, cells, goal_list, meta, out)


def _report(console, cells, goal_list, meta, out: Path) -> None:
    from rich.table import Table

    from adaptspec.sim.fidelity import STEP_HEAD, TABLE_HEAD, arm_summary, plot, step_rows, table_rows

    t = Table(title=f"fidelity: live / simulated (relative error of simulated), {meta['date']}")
    for h in TABLE_HEAD:
        t.add_column(h)
    for row in table_rows(cells):
        t.add_row(*row)
    console.print(t)
    st = Table(title="engine steps per level (all classes)")
    for h in STEP_HEAD:
        st.add_column(h)
    for row in step_rows(cells):
        st.add_row(*row)
    console.print(st)
    for g in goal_list:
        console.print(f"{'[green]met[/green]' if g.met else '[red]missed[/red]'}  {g.name}: {g.detail}")
        for m in g.misses[:8]:
            console.print(f"    {m}")
        if len(g.misses) > 8:
            console.print(f"    ... and {len(g.misses) - 8} more")
    arms = arm_summary(cells)
    if arms:
        console.print(arms)
    for p, g in (meta.get("host_gap") or {"(none)": {}}).items():
        console.print(f"host time between steps, simulated ({p}): {1e3 * g.get('a_s', 0.0):.2f} ms + "
                      f"{1e3 * g.get('per_request_s', 0.0):.3f} ms per request in the step")
    sp = meta.get("speed") or {}
    if sp.get("probed_runs") and "median" in sp:
        what = ("live decode steps / the same steps priced on the profile" if sp.get("source") == "steps"
                else "live probe / calibration probe")
        console.print(f"speed factor ({what}, > 1: the live engine was slower), "
                      f"{sp['probed_runs']} runs: min {sp['min']:.3f}, median {sp['median']:.3f}, max {sp['max']:.3f}; "
                      + ("applied to the simulated step costs per run" if sp.get("applied") else "not applied"))
    pp = meta.get("prompt_speed") or {}
    if pp.get("probed_runs") and "median" in pp:
        what = ("live prompt-carrying steps less their decode rows / their prompt chunks priced"
                if pp.get("source") == "steps" else "live prompt passes / the profile's prompt table")
        console.print(f"prompt factor ({what}), {pp['probed_runs']} runs: "
                      f"min {pp['min']:.3f}, median {pp['median']:.3f}, max {pp['max']:.3f}; applied to the "
                      "simulated prompt passes per run")
    if sp.get("calibration_drift") is not None:
        console.print(f"calibration's own drift (end probe / start probe): {sp['calibration_drift']:.3f}")
    for n in meta["notes"]:
        console.print(f"note: {n}")
    png = plot(cells, out / "fidelity.png", title=f"simulated vs live, {meta['machine']}, {meta['date'][:10]}")
    shapes = out / "step_shapes.md"
    console.print(f"wrote {out / 'fidelity.json'}, {png}, {out / 'scenario.yaml'}"
                  + (f", {shapes} (engine steps by shape: the live ones priced on the profile)" if shapes.is_file()
                     else ""))
