"""`adaptspec demo`: the embedded service under a mixed-class load ramp, watched live.

Starts local Ray + Serve + the app (SmolLM2-135M-Instruct and its draft on the CPU),
sends a first request, then ramps closed-loop concurrency up and down with chat,
code-edit and extraction requests through gRPC while a live table shows the arm the
controller picks per class. Ends with a summary table and a PNG plot, then (by default)
leaves the service up until Ctrl-C.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from typing import Optional

import typer

from adaptspec.clierr import console as _console, fail_cleanly

CLASSES = ["chat", "code_edit", "extraction"]


@dataclass(slots=True)
class Sample:
    t: float
    concurrency: int
    tokens_per_s: float
    batch_size: int
    arms: dict[str, str] = field(default_factory=dict)  # class -> arm


def run_demo(config_path: str | None, levels: list[int], level_seconds: float, max_tokens: int, plot: str,
             keep_running: bool) -> None:
    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    from adaptspec.serve import app as serve_app
    from adaptspec.serve.cli import how_to_call, start_embedded, stats_table, wait_for_ctrl_c
    from adaptspec.serve.client import Client
    from adaptspec.serve.config import load_config
    from adaptspec.serve.loadtest import LoadSpec, run_level, summarize

    console = _console()
    t_start = time.perf_counter()
    cfg = load_config(config_path)
    address = start_embedded(cfg, console)
    client = Client(address, cfg.app_name)
    try:
        r = client.generate("Say hello in five words.", request_class="chat", max_tokens=16, timeout=120)
        console.print(f"[bold green]first response after {time.perf_counter() - t_start:.1f} s[/] "
                      f"(start to answer): {r.text!r}")
        spec = LoadSpec(CLASSES, max_tokens)
        samples: list[Sample] = []
        state = {"level": 0, "stop": False}
        t0 = time.perf_counter()

        def view():
            st = client.stats()
            head = Text(f"load ramp {levels}: now {state['level']} concurrent clients, "
                        f"{time.perf_counter() - t0:.0f}s", style="bold")
            return st, Group(head, stats_table(st, "AdaptSpec demo"))

        def sampler(live):
            while not state["stop"]:
                try:
                    st, renderable = view()
                    rep = st.replicas[0] if st.replicas else None
                    samples.append(Sample(time.perf_counter() - t0, state["level"],
                                          sum(x.tokens_per_s for x in st.replicas), rep.batch_size if rep else 0,
                                          {c.request_class: c.current_arm for c in st.classes}))
                    live.update(renderable)
                except Exception:  # a slow stats call must not stop the demo
                    pass
                time.sleep(0.5)

        summaries = []
        with Live(view()[1], console=console, refresh_per_second=4) as live:
            th = threading.Thread(target=sampler, args=(live,), daemon=True)
            th.start()
            for n in levels:
                state["level"] = n
                recs, window = run_level(client, n, level_seconds, spec)
                summaries.append(summarize("live", n, recs, window, spec))
            state["stop"] = True
            th.join(timeout=5)
        _print_summary(console, summaries)
        console.print(f"plot: {write_plot(samples, plot)}")
        if keep_running:
            console.print(f"\n[bold green]The service stays up.[/] {how_to_call(address, cfg.app_name)}\n"
                          "Ctrl-C stops it.")
            client.close()
            wait_for_ctrl_c(console)  # shuts the service down
            return
    except KeyboardInterrupt:
        console.print("\ninterrupted; shutting down...")
    finally:
        client.close()
    serve_app.stop()


def _print_summary(console, summaries) -> None:
    from rich.table import Table

    from adaptspec.serve.loadtest import top_arm

    t = Table(title="demo summary (per ramp level)")
    for col in ("clients", "requests", "tok/s", "TTFT p50", "TPOT p50", "E2E p50", *[f"arm: {c}" for c in CLASSES]):
        t.add_column(col)
    for s in summaries:
        t.add_row(str(s.concurrency), str(s.requests), f"{s.throughput_tokens_per_s:.1f}", f"{s.ttft_p50_s:.2f}s",
                  f"{s.tpot_p50_s * 1e3:.0f} ms", f"{s.e2e_p50_s:.2f}s",
                  *[top_arm(s.arms.get(c, {})) for c in CLASSES])
    console.print(t)


def write_plot(samples: list[Sample], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ts = [s.t for s in samples]
    ax1.step(ts, [s.concurrency for s in samples], where="post", color="black", label="clients")
    ax1.set_ylabel("concurrent clients")
    ax1b = ax1.twinx()
    tps = [s.tokens_per_s for s in samples]
    smooth = [sum(tps[max(0, i - 5):i + 1]) / len(tps[max(0, i - 5):i + 1]) for i in range(len(tps))]
    ax1b.plot(ts, smooth, color="tab:blue", alpha=0.8, label="tokens/s (3 s mean)")
    ax1b.set_ylabel("tokens/s", color="tab:blue")
    ax1.set_title("AdaptSpec demo: load ramp and the arms the controller picks")
    markers = {"none": "x", "ngram": "s", "draft": "o"}
    for i, cls in enumerate(CLASSES):
        arms = [s.arms.get(cls, "none") for s in samples]
        ks = [0 if a == "none" else int(a.split(":")[1]) for a in arms]
        ax2.step(ts, [k + 0.08 * i for k in ks], where="post", label=cls, color=f"C{i}")
        for d, m in markers.items():
            pts = [(t, k + 0.08 * i) for t, a, k in zip(ts, arms, ks) if a.split(":")[0] == d]
            if pts:
                ax2.scatter(*zip(*pts), marker=m, color=f"C{i}", s=12)
    ax2.set_ylabel("k (o draft, s n-gram, x none)")
    ax2.set_xlabel("seconds")
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@fail_cleanly
def demo(
    config: Optional[str] = typer.Option(None, help="service config YAML (default: embedded SmolLM2 + draft)"),
    levels: str = typer.Option("1,4,8,16,8,4,1", help="the concurrency ramp"),
    level_seconds: float = typer.Option(10.0, help="seconds per ramp level"),
    max_tokens: int = typer.Option(48),
    plot: str = typer.Option("adaptspec_demo.png", help="where to write the PNG plot"),
    keep_running: bool = typer.Option(True, help="leave the service up until Ctrl-C"),
) -> None:
    """Start the embedded service, ramp mixed-class load through gRPC, show what the controller picks."""
    run_demo(config, [int(x) for x in levels.split(",") if x], level_seconds, max_tokens, plot, keep_running)


def register(app) -> None:
    app.command("demo")(demo)
