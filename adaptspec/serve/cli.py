"""CLI commands of the service area: `serve`, `generate`, `stats`, `loadtest`, `demo`."""
from __future__ import annotations

import json
import sys
import time
from typing import Optional

import typer

from adaptspec.clierr import fail_cleanly, console as _console


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.command("generate")(generate)
    app.command("stats")(stats)
    app.command("policy")(policy)
    app.command("loadtest")(loadtest)


def how_to_call(address: str, app_name: str) -> str:
    return (f"gRPC on {address} (application metadata: {app_name!r}). From another terminal:\n"
            f"  adaptspec generate \"Write a haiku about autumn\" --class chat --stream --address {address}\n"
            f"  adaptspec stats --address {address}\n"
            f"  adaptspec loadtest --address {address} --concurrency 1,4,16 --duration 20\n"
            f"  grpcurl -plaintext -H 'application: {app_name}' -d '{{\"prompt\": \"Hi\", \"max_tokens\": 32}}' "
            f"{address} adaptspec.v1.AdaptSpec/Generate")


def start_embedded(config, console):
    """Pull missing models, start local Ray + Serve + the app; returns the client address."""
    from adaptspec.models.registry import resolve
    from adaptspec.serve import app as serve_app

    for spec in filter(None, (config.models.target, config.models.draft)):
        resolve(spec, quiet=True)  # pull once, here, not in every replica
    with console.status("starting Ray, Serve and the AdaptSpec app..."):
        running = serve_app.start(config)
    _term_as_interrupt()
    return running.address


def _term_as_interrupt() -> None:
    """Treat SIGTERM (what Kubernetes and process managers send) like Ctrl-C, so the same
    clean shutdown runs. Installed after Ray's own handler, which would abort the driver
    and leave Ray's agents behind."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def wait_for_ctrl_c(console) -> None:
    from adaptspec.serve import app as serve_app

    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        console.print("\nshutting down...")
    finally:
        serve_app.stop()


@fail_cleanly
def serve(
    config: Optional[str] = typer.Option(None, help="service config YAML (default: embedded SmolLM2 + draft)"),
    host: Optional[str] = typer.Option(None, help="proxy bind address (overrides the config)"),
    port: Optional[int] = typer.Option(None, help="gRPC port (overrides the config)"),
    write_serve_config: Optional[str] = typer.Option(None, help="write the Ray Serve config here and exit"),
) -> None:
    """Run the service: local Ray, Serve's gRPC proxy, TargetEngine (the ingress), Controller."""

    from adaptspec.serve.config import load_config, write_serve_config as write

    cfg = load_config(config)
    if host:
        cfg.host = host
    if port:
        cfg.grpc_port = port
    if write_serve_config:
        print(f"wrote {write(cfg, write_serve_config)} (serve run {write_serve_config})")
        return
    console = _console()
    address = start_embedded(cfg, console)
    console.print(f"[bold green]AdaptSpec is up.[/] {how_to_call(address, cfg.app_name)}\n{_admin_hint(cfg)}\n"
                  "Ctrl-C stops it.")
    wait_for_ctrl_c(console)


def _admin_hint(cfg) -> str:
    """Where the admin token is (never the token itself)."""
    import os

    from adaptspec.serve.auth import token_file

    env = cfg.auth.admin_token_env
    where = f"${env}" if os.environ.get(env, "").strip() else str(token_file())
    return f"Admin calls (adaptspec policy) use the token in {where}."


@fail_cleanly
def generate(
    prompt: str = typer.Argument(..., help="prompt text (chat template applied unless --raw)"),
    request_class: str = typer.Option("", "--class", help="request class (unknown: default)"),
    stream: bool = typer.Option(False, "--stream", help="print tokens as they are accepted"),
    address: str = typer.Option("127.0.0.1:9000", help="gRPC address of the service"),
    app_name: str = typer.Option("adaptspec", "--app", help="Serve application name"),
    max_tokens: Optional[int] = typer.Option(None, help="default: the service's"),
    temperature: Optional[float] = typer.Option(None),
    top_p: Optional[float] = typer.Option(None),
    top_k: int = typer.Option(0),
    seed: Optional[int] = typer.Option(None),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="stop string (repeatable); cut from the text"),
    drafter: Optional[str] = typer.Option(None, help="fix the arm (experiments): none | ngram | draft"),
    k: int = typer.Option(4, help="with --drafter"),
    raw: bool = typer.Option(False),
    timeout: float = typer.Option(120.0, help="deadline in seconds"),
    as_json: bool = typer.Option(False, "--json", help="print the response as JSON"),
) -> None:
    """Call the service's Generate / GenerateStream."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from adaptspec.serve.client import Client

    fields = dict(request_class=request_class, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                  top_k=top_k, seed=seed, raw=raw, stop=stop or [],
                  speculation=(drafter, 0 if drafter == "none" else k) if drafter else None)
    try:
        with Client(address, app_name) as c:
            if stream:
                last = None
                for chunk in c.stream(prompt, timeout=timeout, **fields):
                    if as_json:
                        print(json.dumps(MessageToDict(chunk)))
                    else:
                        sys.stdout.write(chunk.text)
                        sys.stdout.flush()
                    last = chunk
                if not as_json and last is not None:
                    print()
                    _footer(last)
                return
            r = c.generate(prompt, timeout=timeout, **fields)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(MessageToDict(r, always_print_fields_with_no_presence=True)))
    else:
        print(r.text)
        _footer(r)


def _footer(r) -> None:
    s = r.speculation
    arms = ", ".join(f"{a.arm}x{a.steps}" for a in s.arms)
    print(f"[{r.request_class}] {r.usage.completion_tokens} tokens, ttft {r.timings.ttft_s * 1e3:.0f} ms, "
          f"e2e {r.timings.e2e_s:.2f} s, acceptance {s.acceptance_rate:.2f}, mean accepted length "
          f"{s.mean_accepted_length:.2f}, arms {arms}", file=sys.stderr)


def stats_table(st, title: str = "AdaptSpec"):
    from rich.table import Table

    t = Table(title=f"{title}: policy {st.policy} (v{st.policy_version}), up {st.uptime_s:.0f}s")
    for col in ("class", "arm", "requests", "drafted", "accepted", "acceptance", "mean acc. len", "goodput tok/s"):
        t.add_column(col, justify="left" if col in ("class", "arm") else "right")
    for c in st.classes:
        t.add_row(c.request_class, c.current_arm + (" (pinned)" if c.pinned else ""), str(c.requests),
                  str(c.drafted), str(c.accepted), f"{c.acceptance_rate:.2f}", f"{c.mean_accepted_length:.2f}",
                  f"{c.goodput_tokens_per_s:.1f}")
    for r in st.replicas:
        t.caption = ((t.caption + "\n") if t.caption else "") + (
            f"replica {r.replica_id}: batch {r.batch_size}, waiting {r.num_waiting}, in flight {r.in_flight}, "
            f"step {r.step_time_s * 1e3:.1f} ms, {r.tokens_per_s:.1f} tok/s, drafter faults {r.drafter_faults}")
    if st.HasField("controller_cpu_s") and st.uptime_s > 0:
        t.caption = ((t.caption + "\n") if t.caption else "") + (
            f"controller: {st.controller_cpu_s:.1f} CPU s since start ({st.controller_cpu_s / st.uptime_s:.1%} of a "
            f"core), {st.policy_cpu_s:.1f} of them in the policy")
    if len(st.cost_check):
        rows = [{"drafted": r.drafted, "steps": r.steps, "predicted_ms": 1e3 * r.predicted_s / r.steps,
                 "measured_ms": 1e3 * r.measured_s / r.steps} for r in st.cost_check if r.steps]
        t.caption = ((t.caption + "\n") if t.caption else "") + "policy's " + cost_check_line(rows)
    return t


@fail_cleanly
def stats(
    address: str = typer.Option("127.0.0.1:9000", help="gRPC address of the service"),
    app_name: str = typer.Option("adaptspec", "--app"),
    once: bool = typer.Option(False, "--once", help="print one table and exit"),
    as_json: bool = typer.Option(False, "--json"),
    interval: float = typer.Option(1.0, help="refresh seconds"),
) -> None:
    """A live per-class table: arm, acceptance, mean accepted length, goodput; per replica load."""
    from google.protobuf.json_format import MessageToDict
    from rich.live import Live

    from adaptspec.serve.client import Client

    with Client(address, app_name) as c:
        if as_json:
            print(json.dumps(MessageToDict(c.stats())))
            return
        con = _console()
        if once:
            con.print(stats_table(c.stats()))
            return
        try:
            if not con.is_terminal:  # a log or a pipe: a table every interval (a live view shows nothing there)
                while True:
                    con.print(stats_table(c.stats()))
                    time.sleep(interval)
            with Live(stats_table(c.stats()), refresh_per_second=4, console=con) as live:
                while True:
                    time.sleep(interval)
                    live.update(stats_table(c.stats()))
        except KeyboardInterrupt:
            pass


@fail_cleanly
def policy(
    set_policy: Optional[str] = typer.Option(None, "--set", help="switch to this policy (thompson, ucb, ema, "
                                                                  "heuristic, static:<drafter>:<k>)"),
    pin: list[str] = typer.Option([], "--pin", help="CLASS=DRAFTER:K: always use this arm for the class"),
    unpin: list[str] = typer.Option([], "--unpin", help="CLASS: let the policy choose again"),
    reset: bool = typer.Option(False, "--reset", help="start the policy afresh (forget what it learned)"),
    address: str = typer.Option("127.0.0.1:9000", help="gRPC address of the service"),
    app_name: str = typer.Option("adaptspec", "--app"),
    token_file: Optional[str] = typer.Option(None, help="admin token file (default: $ADAPTSPEC_ADMIN_TOKEN, else "
                                                        "$ADAPTSPEC_HOME/admin-token, which `adaptspec serve` writes)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Show the speculation policy, or change it (admin calls: they send the admin token)."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from adaptspec.serve.client import Client

    pins = {}
    for i, p in enumerate(pin):
        cls, _, arm = p.partition("=")
        drafter, _, k = arm.partition(":")
        if not cls or not drafter or not k.isdigit():
            raise ValueError(f"--pin[{i}]: {p!r} is not CLASS=DRAFTER:K (e.g. chat=ngram:4)")
        pins[cls] = (drafter, int(k))
    with Client(address, app_name, token_file=token_file) as c:
        try:
            if set_policy or pins or unpin or reset:
                st = c.update_policy(set_policy or "", pins=pins, unpin=unpin, reset=reset)
            else:
                st = c.policy()
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                              grpc.StatusCode.PERMISSION_DENIED):
                raise ValueError(f"{exc.code().name}: {exc.details()}") from None
            raise
        except PermissionError as exc:  # a token file others can read: fix it before anything is sent
            raise ValueError(str(exc)) from None
    if as_json:
        print(json.dumps(MessageToDict(st)))
        return
    print(f"policy {st.policy} (v{st.version}), drafters {', '.join(st.drafters)}, max_k {st.max_k}")
    for c in st.classes:
        print(f"  {c.request_class:<16} {c.arm:<10} {'pinned' if c.pinned else ''}")


@fail_cleanly
def loadtest(
    address: str = typer.Option("127.0.0.1:9000", help="gRPC address of the service"),
    app_name: str = typer.Option("adaptspec", "--app"),
    concurrency: str = typer.Option("1,4,16", help="comma-separated concurrency levels"),
    rate: str = typer.Option("", help="open-loop arrival rates (requests/s, comma-separated), run instead of the "
                                      "--concurrency levels"),
    arrival: str = typer.Option("poisson", help="open-loop inter-arrival law: poisson | gamma"),
    burstiness: float = typer.Option(1.0, help="gamma shape (< 1: burstier), as vllm bench serve's"),
    think_time: float = typer.Option(0.0, help="closed loop: mean seconds a client pauses between a reply and its "
                                               "next request"),
    think: str = typer.Option("fixed", help="think-time law: fixed | exponential"),
    arrival_seed: int = typer.Option(0, help="seed of the open-loop arrival times and the think times (a scenario "
                                             "with this seed, rate and law draws the same arrival times)"),
    classes: str = typer.Option("chat,code_edit,extraction", help="comma-separated request classes"),
    duration: float = typer.Option(20.0, help="measured seconds per level and run: tokens that arrive in "
                                             "the window, requests that finish in it"),
    max_tokens: int = typer.Option(64),
    policies: str = typer.Option("", help="comma-separated policies to compare via UpdatePolicy "
                                          "(e.g. thompson,static:none:0,static:draft:4); empty: as deployed"),
    warmup: float = typer.Option(5.0, help="seconds of load before each measured window (learning); the "
                                           "clients keep going into the window, so its load is steady"),
    rounds: int = typer.Option(1, help="measured runs per policy and level, interleaving the policies "
                                       "(seconds measured per policy and level: rounds x duration)"),
    level_warmup: float = typer.Option(
        15.0, help="unmeasured seconds of load at each new level before its first round, under the first static "
                   "policy listed (else the first): the first run at a new load runs slow whatever its policy "
                   "(0.88 of its later rounds, measured), which would be charged to the first policy"),
    fresh: bool = typer.Option(False, "--fresh", help="start each run's policy afresh (the cold start); "
                                                      "default: an adaptive policy resumes what it learned in "
                                                      "its earlier runs, as a deployed controller keeps learning"),
    slo_ttft: float = typer.Option(2.0, help="TTFT SLO (s) for goodput"),
    slo_tpot: float = typer.Option(0.25, help="TPOT SLO (s) for goodput"),
    overhead: int = typer.Option(0, help="also measure gRPC + Serve overhead over the in-process engine on "
                                         "this many prompts (needs the service's models locally)"),
    overhead_reps: int = typer.Option(3, help="runs of each overhead prompt through each path"),
    overhead_only: bool = typer.Option(False, help="measure only the overhead (no load levels)"),
    http_overhead: int = typer.Option(0, help="also measure the OpenAI-compatible HTTP API's per-request cost over "
                                              "gRPC on this many paired requests (one prompt through both, back to "
                                              "back; --http-url; under the last of --policies, else as deployed)"),
    config: Optional[str] = typer.Option(None, help="the service's config YAML: the in-process baseline "
                                                    "copies its model, dtype, KV slots and torch threads"),
    target: Optional[str] = typer.Option(None, help="model for the in-process baseline (default: the config's)"),
    torch_threads: Optional[int] = typer.Option(None, help="torch threads of the in-process baseline "
                                                           "(default: the replica's)"),
    start: bool = typer.Option(False, "--start", help="first start the service of --config (default: the "
                                                      "embedded one) in this process, and stop it at the end: "
                                                      "one command, and the overhead baseline shares the "
                                                      "service's CPU scheduling group"),
    probes: int = typer.Option(0, help="keep this many clients calling Health/Check (as Kubernetes probes and "
                                       "monitoring do) from another process throughout: Serve work in the "
                                       "replica next to its engine"),
    in_process: bool = typer.Option(False, "--in-process", help="no Ray cluster, no gRPC: the replica's engine and the "
                                                                "controller of --config in this process, driven as "
                                                                "a replica drives them; also prints the controller's "
                                                                "predicted step times against the measured ones"),
    prompt_tokens: Optional[str] = typer.Option(None, help="LO-HI: put a context of about uniform(LO, HI) tokens "
                                                          "before each prompt (long prompts arriving among "
                                                          "running requests; e.g. 100-1500)"),
    protocol: str = typer.Option("grpc", help="what the load speaks: grpc, or http (the OpenAI-compatible API at "
                                             "--http-url: streamed chat completions; policy switches and stats "
                                             "still go through gRPC)"),
    http_url: str = typer.Option("http://127.0.0.1:8000", help="the service's HTTP proxy for --protocol http "
                                                               "(the app's route /<app> is added; --start: its port)"),
    api_key: Optional[str] = typer.Option(None, envvar="OPENAI_API_KEY",
                                          help="API key, sent over HTTP and gRPC (gRPC without it: $ADAPTSPEC_API_KEY)"),
    prompts: Optional[str] = typer.Option(None, help="the requests' prompts: corpus:N[:SEED] (N a class from "
                                          "the held-out split of the offline distillation corpus) or a JSON file "
                                          "{class: [prompt, ...]}; default: the bench prompts (eight a class)"),
    json_path: Optional[str] = typer.Option(None, "--json", help="write results to this JSON file"),
) -> None:
    """Closed-loop load on loopback gRPC (or the OpenAI-compatible HTTP API: --protocol http): TTFT,
    TPOT, E2E p50/p99, throughput, goodput, arms."""
    from rich.table import Table

    from adaptspec.serve.client import Client
    from adaptspec.serve.loadtest import HttpClient, LoadSpec, Probes, as_json, load_prompts, run_level, top_arm

    console = _console()
    class_list = [c for c in classes.split(",") if c]
    spec = LoadSpec(class_list, max_tokens, slo_ttft, slo_tpot, prompt_tokens=_span(prompt_tokens, "--prompt-tokens"),
                    prompts=load_prompts(prompts, class_list), prompts_from=prompts or "bench")
    levels = load_levels(concurrency, rate, arrival, burstiness, think_time, think, arrival_seed)
    results = []
    over = probed = bg = None
    if protocol not in ("grpc", "http"):
        raise ValueError(f"--protocol: grpc or http, got {protocol!r}")
    if in_process:
        bad = [name for name, on in (("--start", start), ("--protocol http", protocol == "http"),
                                     ("--overhead", overhead), ("--overhead-only", overhead_only),
                                     ("--probes", probes)) if on]
        if bad:
            raise ValueError(f"--in-process: {', '.join(bad)} need the service (no Serve runs in-process)")
        return _loadtest_in_process(config, torch_threads, levels, [p for p in policies.split(",") if p], spec,
                                    duration, warmup, rounds, fresh, json_path, console, level_warmup)
    if start:
        from adaptspec.serve.config import load_config

        cfg = load_config(config)
        address, app_name = start_embedded(cfg, console), cfg.app_name
        http_url = f"http://127.0.0.1:{cfg.http_port}"
    try:
        with Client(address, app_name, api_key=api_key) as c:
            c.wait_ready(30)
            deployed = c.policy().policy
            bg = Probes(address, app_name, probes)
            load = c if protocol == "grpc" else HttpClient(f"{http_url.rstrip('/')}/{app_name}", api_key)
            pols = [] if overhead_only else [p for p in policies.split(",") if p] or [deployed]
            results = _interleaved_levels(
                levels if pols else [], pols, rounds, fresh, spec, console, current=lambda: c.policy().policy,
                switch=lambda p, reset: c.update_policy(p, reset=reset),
                run_one=lambda n: run_level(load, n, duration, spec, warmup_s=warmup),
                usage=lambda: controller_usage(c.stats()),
                warm_one=(lambda n: run_level(load, n, level_warmup, spec)) if level_warmup > 0 else None)
            if http_overhead:
                http_vs_grpc = _http_overhead(c, HttpClient(f"{http_url.rstrip('/')}/{app_name}", api_key),
                                              http_overhead, spec, [p for p in policies.split(",") if p], console)
            if policies and deployed != c.policy().policy:
                c.update_policy(deployed)
            if overhead:
                over = _overhead(c, overhead, overhead_reps, max_tokens, config, target, torch_threads)
                ci = {k: " to ".join(f"{x * 1e3:.1f}" for x in over[f"{k}_p50_ci95_s"])
                      for k in ("overhead", "inside_engine")}
                console.print(
                    f"overhead (gRPC + Serve over the in-process engine, {over['requests']} paired requests of "
                    f"{max_tokens} tokens): p50 {over['overhead_p50_s'] * 1e3:.1f} ms (95% interval "
                    f"{ci['overhead']}), p90 "
                    f"{over['overhead_p90_s'] * 1e3:.1f} ms, ratio p50 {over['ratio_p50']:.3f} (service "
                    f"{over['service_e2e_p50_s'] * 1e3:.1f} ms, engine {over['engine_e2e_p50_s'] * 1e3:.1f} ms); "
                    f"outside the replica's engine {over['outside_engine_p50_s'] * 1e3:.1f} ms, inside "
                    f"{over['inside_engine_p50_s'] * 1e3:.1f} ms (95% interval {ci['inside_engine']}); "
                    f"same tokens {over['same_tokens']}/{over['requests']}; "
                    f"a Health/Check round trip (the path without engine work) p50 "
                    f"{over['health_check_p50_s'] * 1e3:.1f} ms")
        if http_overhead:
            over = {**(over or {}), "http_vs_grpc": http_vs_grpc}
        probed = bg.stop()
        if probed:
            console.print(f"probes: {probed['clients']} clients, {probed['calls_per_s']:.0f} Health/Check "
                          f"calls/s in the background, {probed['errors']} errors")
    finally:
        if bg is not None:
            bg.stop()
        if start:
            from adaptspec.serve import app as serve_app

            serve_app.stop()
    if overhead_only:
        if json_path:
            with open(json_path, "w") as f:
                f.write(as_json([], over, probed, spec.prompts_from))
        return
    t = Table(title="loadtest")
    for col in ("policy", "conc.", "req", "err", "tok/s", "goodput req/s", "TTFT p50/p99", "TPOT p50/p99",
                "E2E p50/p99", "gap p99/max", "arms (top per class)"):
        t.add_column(col)
    for s in results:
        t.add_row(s.policy, s.level, str(s.requests), str(s.errors), f"{s.throughput_tokens_per_s:.1f}",
                  f"{s.goodput_requests_per_s:.2f}", f"{s.ttft_p50_s:.2f}/{s.ttft_p99_s:.2f}",
                  f"{s.tpot_p50_s * 1e3:.0f}/{s.tpot_p99_s * 1e3:.0f} ms", f"{s.e2e_p50_s:.2f}/{s.e2e_p99_s:.2f}",
                  f"{s.gap_p99_s * 1e3:.0f}/{s.gap_max_s * 1e3:.0f} ms",
                  ", ".join(f"{k}:{top_arm(v)}" for k, v in s.arms.items()))
    console.print(t)
    for line in adaptive_vs_static(results):
        console.print(line)
    if json_path:
        with open(json_path, "w") as f:
            f.write(as_json(results, over, probed, spec.prompts_from))
        console.print(f"wrote {json_path}")


def load_levels(concurrency: str, rate: str, arrival: str = "poisson", burstiness: float = 1.0,
                think_time: float = 0.0, think: str = "fixed", seed: int = 0) -> list:
    """The load test's levels from its options: client counts (a plain int when the clients do
    not think) or, with ``rate``, open-loop ``Arrivals``; ValueError names the option."""
    from adaptspec.serve.loadtest import Arrivals

    if arrival not in ("poisson", "gamma"):
        raise ValueError(f"--arrival: poisson or gamma, got {arrival!r}")
    if think not in ("fixed", "exponential"):
        raise ValueError(f"--think: fixed or exponential, got {think!r}")
    if not burstiness > 0 or not think_time >= 0:
        raise ValueError(f"--burstiness must be > 0 and --think-time >= 0, got {burstiness}, {think_time}")
    if rate:
        try:
            rates = [float(x) for x in rate.split(",") if x]
        except ValueError:
            rates = []
        if not rates or any(not r > 0 for r in rates):
            raise ValueError(f"--rate: positive requests/s, comma-separated, got {rate!r}")
        return [Arrivals(rate_rps=r, process=arrival, burstiness=burstiness, seed=seed) for r in rates]
    try:
        counts = [int(x) for x in concurrency.split(",") if x]
    except ValueError:
        counts = []
    if not counts or any(n < 1 for n in counts):
        raise ValueError(f"--concurrency: positive integers, got {concurrency!r}")
    if not think_time:
        return counts
    return [Arrivals(clients=n, think_s=think_time, think=think, seed=seed) for n in counts]


def _span(text: str | None, name: str) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        lo, hi = (int(x) for x in text.split("-"))
    except ValueError:
        raise ValueError(f"{name}: expected LO-HI (two integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"{name}: need 1 <= LO <= HI, got {text!r}")
    return lo, hi


def _http_overhead(c, http, n: int, spec, pols: list[str], console) -> dict:
    """``loadtest --http-overhead``: paired HTTP vs gRPC requests (in the JSON: ``overhead.http_vs_grpc``)."""
    from adaptspec.serve.loadtest import measure_http_overhead

    if pols and c.policy().policy != pols[-1]:
        c.update_policy(pols[-1])
    h = measure_http_overhead(c, http, n, spec.max_tokens, spec.classes)
    ms = lambda k: f"{h[k] * 1e3:.1f}"  # noqa: E731
    ci = lambda k: " to ".join(f"{x * 1e3:.1f}" for x in h[k])  # noqa: E731
    console.print(f"HTTP vs gRPC ({h['requests']} paired requests of {spec.max_tokens} tokens, {h['errors']} with an "
                  f"error): E2E p50 {ms('http_e2e_p50_s')} vs {ms('grpc_e2e_p50_s')} ms, difference p50 "
                  f"{ms('e2e_diff_p50_s')} ms (95% interval {ci('e2e_diff_p50_ci95_s')}); TTFT p50 "
                  f"{ms('http_ttft_p50_s')} vs {ms('grpc_ttft_p50_s')} ms, difference p50 {ms('ttft_diff_p50_s')} "
                  f"ms (95% interval {ci('ttft_diff_p50_ci95_s')}); same tokens {h['same_tokens']}/{h['requests']}")
    return h


def _interleaved_levels(levels, pols, rounds, fresh, spec, console, *, current, switch, run_one,
                        usage=None, warm_one=None) -> list:
    """Per level, ``rounds`` runs of every policy, interleaved (order reversed every other
    round, so drift in the machine's load hits every policy alike; each run has its own
    warm-up); one printed and returned summary per (level, policy). ``current()`` names the
    policy in force, ``switch(policy, reset)`` changes it, ``run_one(concurrency)`` returns
    one run's (records, window); ``usage()`` (optional) the controller's counters so far, read
    around every run: CPU seconds in the policy's calls, in its whole process (or None), and
    its cost check's rows ({(from, drafted): [steps, predicted s, measured s]}); ``warm_one(concurrency)``
    (optional) an unmeasured run at each level before its first round, under the first static policy
    listed (else the first): the first run at a new load ran slow whatever its policy, and the
    interleaving put one policy there at every level."""
    from adaptspec.serve.controller import CostCheck
    from adaptspec.serve.loadtest import as_arrivals, summarize, top_arm

    results = []
    for n in levels:
        recs: dict[str, list] = {p: [] for p in pols}
        windows: dict[str, list] = {p: [] for p in pols}
        per_round: dict[str, list[float]] = {p: [] for p in pols}
        cpu: dict[str, list[float]] = {p: [0.0, 0.0, 0.0] for p in pols}  # wall, policy, process seconds
        checks: dict[str, CostCheck] = {p: CostCheck() for p in pols}  # each policy's steps at this level
        round_arms: dict[str, list[dict]] = {p: [] for p in pols}
        round_checks: dict[str, list[list]] = {p: [] for p in pols}
        if warm_one is not None and pols:
            pol = next((p for p in pols if p.startswith("static")), pols[0])
            if fresh or pol != current():
                switch(pol, fresh)
            warm_one(n)
        for r in range(rounds):
            for pol in pols if r % 2 == 0 else pols[::-1]:
                if fresh or pol != current():
                    switch(pol, fresh)
                before, t0 = usage() if usage else None, time.perf_counter()
                got, window = run_one(n)
                one = CostCheck()
                if before is not None:
                    after = usage()
                    cpu[pol][0] += time.perf_counter() - t0
                    cpu[pol][1] += after[0] - before[0]
                    cpu[pol][2] = cpu[pol][2] + after[1] - before[1] if None not in (after[1], before[1]) else None
                    for key, row in after[2].items():
                        old = before[2].get(key, (0.0, 0.0, 0.0))
                        one.rows[key] = delta = [row[i] - old[i] for i in range(3)]
                        pooled = checks[pol].rows.setdefault(key, [0.0, 0.0, 0.0])
                        pooled[:] = [a + b for a, b in zip(pooled, delta)]
                recs[pol] += got
                windows[pol].append(window)
                this = summarize(pol, n, got, window, spec)
                per_round[pol].append(this.throughput_tokens_per_s)
                round_arms[pol].append(this.arms)
                round_checks[pol].append(cost_check_ratios(one.table()))
        for pol in pols:
            s = summarize(pol, n, recs[pol], windows[pol], spec)
            s.round_tokens_per_s = per_round[pol] if rounds > 1 else []
            wall, policy_s, process_s = cpu[pol]
            if wall > 0:
                s.policy_cpu_share = policy_s / wall
                s.controller_cpu_share = None if process_s is None else process_s / wall
            s.cost_check = checks[pol].table()
            if rounds > 1:
                s.round_arms = round_arms[pol]
                s.round_cost_check = round_checks[pol] if s.cost_check else []
            results.append(s)
            load = (f"  controller CPU {s.controller_cpu_share:.1%} of a core (policy {s.policy_cpu_share:.1%})"
                    if s.controller_cpu_share is not None else
                    f"  policy CPU {s.policy_cpu_share:.1%} of a core" if s.policy_cpu_share is not None else "")
            console.print(f"{pol:>18} {as_arrivals(n).label:<6} {s.throughput_tokens_per_s:7.1f} tok/s  goodput "
                          f"{s.goodput_requests_per_s:5.2f} req/s  e2e p50 {s.e2e_p50_s:.2f}s  "
                          f"arms {', '.join(f'{k}:{top_arm(v)}' for k, v in s.arms.items())}{load}")
            if s.cost_check:
                by_round = "".join(
                    f"{' ' if i else '; round by round (plain/drafted) '}"
                    + "/".join(f"{x[0]:.3f}" if x else "-" for x in r) for i, r in enumerate(s.round_cost_check))
                console.print(f"{'':>18} {'':<6} {cost_check_line(s.cost_check)}{by_round}")
    return results


def controller_usage(stats) -> tuple[float, float | None, dict]:
    """(policy CPU seconds, controller process CPU seconds or None, cost check rows) from a
    GetStatsResponse (see ``_interleaved_levels``)."""
    rows = {(r.verify_tokens_from, r.drafted): (float(r.steps), r.predicted_s, r.measured_s) for r in stats.cost_check}
    return stats.policy_cpu_s, stats.controller_cpu_s if stats.HasField("controller_cpu_s") else None, rows


def cost_check_ratios(rows: list[dict]) -> list:
    """[plain, drafted]: each kind of step's predicted / measured step time and steps, [ratio,
    steps] (None where no step of that kind ran), from cost check rows."""
    out = []
    for drafted in (False, True):
        sel = [r for r in rows if r["drafted"] == drafted]
        n = sum(r["steps"] for r in sel)
        pred, meas = (sum(r[k] * r["steps"] for r in sel) for k in ("predicted_ms", "measured_ms"))
        out.append([pred / meas, n] if n and meas > 0 else None)
    return out


def cost_check_line(rows: list[dict]) -> str:
    """The learned step time over the measured one, for plain steps and steps with drafted rows."""
    parts = [f"{name} {got[0]:.3f} ({got[1]})" for name, got in zip(("plain steps", "steps with drafted rows"),
                                                                    cost_check_ratios(rows)) if got]
    return "predicted / measured step time: " + ", ".join(parts)


def cost_check_table(policy: str, rows: list[dict]):
    from rich.table import Table

    ct = Table(title=f"{policy}: the controller's step time (decode part) against the measured one")
    for col in ("verify tokens", "drafted rows", "steps", "predicted ms", "measured ms"):
        ct.add_column(col)
    for row in rows:
        ct.add_row(row["verify_tokens"], "yes" if row["drafted"] else "no", str(row["steps"]),
                   f"{row['predicted_ms']:.1f}", f"{row['measured_ms']:.1f}")
    return ct


def _loadtest_in_process(config, torch_threads, levels, policies, spec, duration, warmup, rounds, fresh, json_path,
                         console, level_warmup: float = 0.0) -> None:
    from rich.progress import Progress
    from rich.table import Table

    from adaptspec.serve.config import load_config
    from adaptspec.serve.inprocess import InProcessService
    from adaptspec.serve.loadtest import as_json, top_arm

    cfg = load_config(config)
    with console.status("loading the models"):
        svc = InProcessService(cfg, torch_threads=torch_threads)
    pols = policies or [svc.policy()]
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("runs", total=len(levels) * rounds * len(pols))

        def run_one(n: int):
            bar.update(task, description=f"c={n} {svc.policy()}")
            out = svc.run_level(n, duration, spec, warmup_s=warmup)
            bar.advance(task)
            return out

        results = _interleaved_levels(levels, pols, rounds, fresh, spec, console, current=svc.policy,
                                      switch=lambda p, reset: svc.update_policy(p, reset=reset), run_one=run_one,
                                      usage=svc.usage, warm_one=(lambda n: svc.run_level(n, level_warmup, spec))
                                      if level_warmup > 0 else None)
    t = Table(title="loadtest (in-process: engine and controller, no Serve, no gRPC)")
    for col in ("policy", "conc.", "req", "tok/s", "tok per decode-s", "TTFT p50/p99", "TPOT p50/p99",
                "gap p99/max", "arms (top per class)"):
        t.add_column(col)
    per_decode_s = {key: tok / sec if sec > 0 else 0.0 for key, (tok, sec) in svc.decode.items()}
    t.add_column("step p50/max")
    for s in results:
        t.add_row(s.policy, s.level, str(s.requests), f"{s.throughput_tokens_per_s:.1f}",
                  f"{per_decode_s.get((s.policy, s.level), 0.0):.1f}",
                  f"{s.ttft_p50_s:.2f}/{s.ttft_p99_s:.2f}", f"{s.tpot_p50_s * 1e3:.0f}/{s.tpot_p99_s * 1e3:.0f} ms",
                  f"{s.gap_p99_s * 1e3:.0f}/{s.gap_max_s * 1e3:.0f} ms",
                  ", ".join(f"{k}:{top_arm(v)}" for k, v in s.arms.items()),
                  "{:.0f}/{:.0f} ms".format(*(x * 1e3 for x in svc.step_wall(s.policy, s.level))))
    console.print(t)
    for line in adaptive_vs_static(results):
        console.print(line)
    console.print("tokens per decode-second (the steps' emitted tokens over their time less prefill; the prompt mix "
                  "does not move it):")
    for line in adaptive_vs_static(results, lambda s: per_decode_s.get((s.policy, s.level), 0.0),
                                   verdict=False, rounds=None):
        console.print(line + " per decode-second")
    checks = {p: c.table() for p, c in svc.core.cost_checks.items() if c.rows}
    for pol, rows in checks.items():
        console.print(cost_check_table(pol, rows))
    if json_path:
        data = json.loads(as_json(results, prompts=spec.prompts_from))
        for lv in data["levels"]:
            lv["decode_tokens_per_s"] = per_decode_s.get((lv["policy"], lv["level"]), 0.0)
            lv["step_p50_s"], lv["step_max_s"] = svc.step_wall(lv["policy"], lv["level"])
        data["in_process"] = True
        data["cost_check"] = checks
        with open(json_path, "w") as f:
            json.dump(data, f, indent=1)
        console.print(f"wrote {json_path}")


def adaptive_vs_static(results, value=lambda s: s.throughput_tokens_per_s, verdict: bool = True,
                       rounds=lambda s: getattr(s, "round_tokens_per_s", None)) -> list[str]:
    """Per level, each adaptive policy's ``value`` (throughput) over the best static arm's
    (the goal: >= 0.95, shown when ``verdict``). With several rounds (``rounds``: a summary's
    per-round values, None: not shown) also the ratio round by round: the policies of a round
    ran within a minute or two of each other, so the spread of those ratios is what the
    machine's drift and the load's noise leave in the verdict's ratio."""
    out = []
    level = lambda s: getattr(s, "level", "") or f"c={s.concurrency}"  # noqa: E731
    for n in dict.fromkeys(level(s) for s in results):  # levels in the order they ran
        static = [s for s in results if level(s) == n and s.policy.startswith("static")]
        if not static:
            continue
        best = max(static, key=value)
        for s in results:
            if level(s) == n and not s.policy.startswith("static") and value(best) > 0:
                r = value(s) / value(best)
                # three decimals and the verdict: 0.945 printed as "0.95" read as met
                line = f"{n}: {s.policy} / best static ({best.policy}) = {r:.3f}" + \
                    (f" ({'>=' if r >= 0.95 else '<'} 0.95)" if verdict else "")
                mine, theirs = (rounds(s), rounds(best)) if rounds is not None else (None, None)
                if mine and theirs and len(mine) == len(theirs) > 1 and all(t > 0 for t in theirs):
                    line += "; round by round " + " ".join(f"{a / b:.3f}" for a, b in zip(mine, theirs))
                out.append(line)
    return out


def _overhead(client, n: int, reps: int, max_tokens: int, config: Optional[str], target: Optional[str],
              torch_threads: Optional[int]) -> dict:
    """Build an in-process engine like the service's replica and measure the paired overhead."""
    from adaptspec.serve.config import load_config
    from adaptspec.serve.engine_proc import build_engine
    from adaptspec.serve.loadtest import bench_prompts, measure_overhead

    # the replica's builder, so both sides run the same engine with the replica's drafters
    # (like for like; the head's per-step feature hand-off measured at nothing noticeable,
    # see docs/results/service-runs.md)
    engine = build_engine(load_config(config), target=target, torch_threads=torch_threads)
    prompts = [p for ps in bench_prompts().values() for p in ps][:n]
    return measure_overhead(client, engine, prompts, max_tokens, reps, health_checks=100)
