"""Time ``LlamaModel.forward`` per matmul layout (the forward tables in docs/benchmarks.md).

    python -m adaptspec.models.forward_bench --dtype bfloat16 --layouts packed,fast

One sequence over ``--cached`` tokens: a forward of 1 / 2 / 5 / 9 new tokens (decoding one,
verifying k + 1 candidates) and a prefill of ``--prefill`` tokens into a second slot. Every
layout is loaded in this one process and the layouts alternate, order reversed every other
repetition, so drift in the machine's speed hits them alike; the medians are printed, with
the 5-token / 1-token ratio (what verification costs in decode steps).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from adaptspec.models.batch import FlatBatch

SIZES = (1, 2, 5, 9)
BS = 16  # KV block size


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layouts", default="packed,fast",
                    help="packed (the CPU kernel), fast (torch), reference; a '-unfused' suffix runs the "
                         "decode/verify layers on torch ops instead of the C layer ops; '-widened' packs "
                         "bf16 weights widened to fp32 (fp32 inputs) instead of in pairs (VDPBF16PS)")
    ap.add_argument("--cached", type=int, default=200)
    ap.add_argument("--prefill", type=int, default=150)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)

    from adaptspec.models import cpu_gemm
    from adaptspec.models.loader import load_model

    torch.set_num_threads(a.threads)
    models, tables = {}, {}
    for lay in a.layouts.split(","):
        base, _, suffix = lay.partition("-")
        if suffix not in ("", "unfused", "widened"):
            raise SystemExit(f"--layouts: unknown suffix in {lay!r} (-unfused, -widened)")
        dot = cpu_gemm.BF16_DOT
        cpu_gemm.BF16_DOT = dot and suffix != "widened"  # bf16 weights packed widened, not in pairs
        try:
            m = load_model(a.target, dtype=a.dtype, matmul=base, quiet=True).model
        finally:
            cpu_gemm.BF16_DOT = dot
        m.fused = m.fused and suffix != "unfused"
        per_seq = -(-(a.cached + a.prefill + max(SIZES) + 1) // BS)
        m.allocate_kv(2 * per_seq, BS)
        tables[lay] = [list(range(per_seq)), list(range(per_seq, 2 * per_seq))]
        m.forward(FlatBatch.build([torch.randint(0, 1000, (a.cached,)).tolist()], [0], tables[lay][:1],
                                  [a.cached - 1], BS, m.device))
        models[lay] = m
    g = torch.Generator().manual_seed(0)

    def once(lay: str, m, n: int) -> float:
        ids = torch.randint(0, 1000, (n,), generator=g).tolist()
        t = time.perf_counter()
        if n == a.prefill:  # a new prompt in sequence 1
            m.forward(FlatBatch.build([ids], [0], tables[lay][1:], [n - 1], BS, m.device))
        else:  # new tokens over sequence 0's cached prefix (written at the same positions each time)
            m.forward(FlatBatch.build([ids], [a.cached], tables[lay][:1], list(range(n)), BS, m.device))
        return (time.perf_counter() - t) * 1e3

    sizes = (*SIZES, a.prefill)
    times = {lay: {n: [] for n in sizes} for lay in models}
    for rep in range(a.reps + 1):  # the first repetition warms up
        order = list(models.items()) if rep % 2 == 0 else list(models.items())[::-1]
        for n in sizes:
            for lay, m in order:
                t = once(lay, m, n)
                if rep:
                    times[lay][n].append(t)
    print(f"{a.target} {a.dtype}, {a.threads} threads, {a.cached} cached tokens; median ms of {a.reps}")
    print(f"{'layout':>10} " + " ".join(f"{n:>8}" for n in SIZES) + f" {'prefill ' + str(a.prefill):>12}   5 / 1")
    for lay, ts in times.items():
        med = {n: statistics.median(v) for n, v in ts.items()}
        print(f"{lay:>10} " + " ".join(f"{med[n]:8.1f}" for n in SIZES) + f" {med[a.prefill]:12.1f}   "
              f"{med[5] / med[1]:.2f}")


if __name__ == "__main__":
    main()
