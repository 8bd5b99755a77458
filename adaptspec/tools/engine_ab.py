"""`adaptspec bench-ab`: this tree's engine against another commit's, in one run.

The machine's speed drifts 10-40% between minutes, so a ratio is only meaningful when both
sides run in turn: every round runs each side once (alternating which goes first), each in
a fresh subprocess (two ``adaptspec`` packages cannot share a process), and the ratio is
taken per round and then its median. The baseline is checked out with ``git worktree``
into a temporary folder and imported from there; models come from the same cache.

Measured per (dtype, batch): plain decoding tokens/s over fixed prompts and token counts
(``ignore_eos``, greedy), after a warm-up generation in the same process.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer

# runs in the child: imports ``adaptspec`` from sys.argv[1] and prints one JSON line
_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from adaptspec import Engine, SamplingParams, SpecConfig
target, dtype, batch, tokens, reps = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
e = Engine.from_pretrained(target, dtype=dtype, max_num_seqs=max(batch, 1))
sp = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
prompts = ["Write a long story about a dragon who learns to code in Python.",
           "Explain how a hash map works, with an example in C.",
           "List ten facts about the moon and explain each one briefly.",
           "Summarize the plot of a detective novel set in Venice."]
chunk = [prompts[i % len(prompts)] for i in range(batch)]
e.generate(chunk, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
best = []
for _ in range(reps):
    steps = []
    e.step_listeners[:] = [steps.append]
    t = time.perf_counter()
    e.generate(chunk, sp)
    wall = time.perf_counter() - t
    decode = sum(s.wall_s - s.prefill_s for s in steps)  # the prompt's part left out
    best.append(batch * (tokens - 1) / decode)
print(json.dumps({"tok_s": sorted(best)[len(best) // 2], "file": __import__("adaptspec").__file__}))
"""


def _checkout(repo: Path, ref: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-f", str(into), ref],
                   check=True, capture_output=True, text=True)
    return into


def _run(src: Path, target: str, dtype: str, batch: int, tokens: int, reps: int, threads: int | None) -> float:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(src), target, dtype, str(batch), str(tokens), str(reps)],
                         check=True, capture_output=True, text=True, env=env)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
    got = json.loads(line)
    if not got["file"].startswith(str(src)):
        raise RuntimeError(f"the child imported adaptspec from {got['file']}, not {src}")
    return float(got["tok_s"])


def bench_ab(
    baseline: str = typer.Option("e7f4fc7", help="git ref of the engine to compare against"),
    target: str = typer.Option("smollm2-135m", help="target model"),
    dtypes: str = typer.Option("float32,bfloat16", help="comma-separated dtypes"),
    batches: str = typer.Option("1,8", help="comma-separated batch sizes"),
    tokens: int = typer.Option(64, help="new tokens per request"),
    rounds: int = typer.Option(3, help="rounds of (this tree, baseline) runs, alternating who goes first"),
    reps: int = typer.Option(2, help="generations per run (the median counts)"),
    json_path: str = typer.Option(None, "--json", help="write the results here"),
) -> None:
    """Plain decoding tokens/s of this tree's engine over a baseline commit's, as ratios."""
    from rich.console import Console
    from rich.table import Table

    con = Console()
    here = Path(__file__).resolve().parents[2]
    rows = []
    with tempfile.TemporaryDirectory(prefix="adaptspec-ab-") as tmp:
        base = _checkout(here, baseline, Path(tmp) / "baseline")
        try:
            for dtype in dtypes.split(","):
                for batch in (int(b) for b in batches.split(",")):
                    ratios, ours_l, theirs_l = [], [], []
                    for r in range(rounds):
                        order = [("ours", here), ("base", base)]
                        if r % 2:
                            order.reverse()
                        got = {name: _run(src, target, dtype, batch, tokens, reps, None) for name, src in order}
                        ours_l.append(got["ours"])
                        theirs_l.append(got["base"])
                        ratios.append(got["ours"] / got["base"])
                        con.print(f"{dtype} batch {batch} round {r + 1}: ours {got['ours']:.1f} tok/s, "
                                  f"{baseline} {got['base']:.1f} tok/s, ratio {ratios[-1]:.3f}")
                    rows.append({"dtype": dtype, "batch": batch, "ours_tok_s": statistics.median(ours_l),
                                 "baseline_tok_s": statistics.median(theirs_l),
                                 "ratio_median": statistics.median(ratios), "ratios": ratios})
        finally:
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(base)], capture_output=True)
    t = Table(title=f"plain decoding, this tree / {baseline} (tok/s of the decode part, median of {rounds} rounds)")
    for col in ("dtype", "batch", "ours tok/s", f"{baseline} tok/s", "ratio (median)", "ratios"):
        t.add_column(col)
    for row in rows:
        t.add_row(row["dtype"], str(row["batch"]), f"{row['ours_tok_s']:.1f}", f"{row['baseline_tok_s']:.1f}",
                  f"{row['ratio_median']:.3f}", " ".join(f"{x:.2f}" for x in row["ratios"]))
    con.print(t)
    if json_path:
        Path(json_path).write_text(json.dumps({"baseline": baseline, "machine": platform.processor() or
                                               platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
                                               "tokens": tokens, "rounds": rounds, "rows": rows}, indent=2))
        con.print(f"wrote {json_path}")


def register(app: typer.Typer) -> None:
    app.command("bench-ab")(bench_ab)
