"""Verification kernels against the pure-torch verifier: wall time per call, one table.

    python -m adaptspec.tools.kernel_bench --device cuda [--json out.json]

Grid: batch {1, 64, 256} x k {1, 4, 8} x vocabulary {32k, 128k}, every request drafting k
tokens with a draft distribution q (draft-model drafting), target logits in --dtype.

* greedy: ``verify_greedy`` against ``greedy_verify``.
* stochastic: the engine's torch path (``logits_to_probs`` with per-row temperature, then
  ``verify_stochastic``) against ``stochastic_verify_from_logits`` (temperature softmax fused).

Times are medians of wall time per call including launches and host syncs (device
synchronised after each call), after warm-up. The kernels get ``max_num_draft_tokens`` from
the host (the engine knows it); the torch reference reads it from the device as it does in
the engine. ``same`` is the share of requests whose output rows are identical. On the CPU
(``--device cpu``) the kernels run in the Triton interpreter: use tiny sizes, e.g.
``--batch 2 --k 2 --vocab 64 --iters 1``.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from adaptspec_kernels.testing import load_kernels


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn, device: str, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _inputs(batch: int, k: int, vocab: int, device: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    num_tokens, num_drafts = batch * (k + 1), batch * k
    logits = torch.randn(num_tokens, vocab, generator=g, device=device).mul_(3).to(dtype)  # [num_tokens, vocab]
    q = torch.softmax(torch.randn(num_drafts, vocab, generator=g, device=device) * 3, -1)  # [num_drafts, vocab]
    # drafted tokens: mostly the target's argmax (so some are accepted), some from q
    rows = torch.arange(num_tokens, device=device).view(batch, k + 1)[:, :k].reshape(-1)
    drafts = torch.where(torch.rand(num_drafts, generator=g, device=device) < 0.7, logits[rows].argmax(-1),
                         torch.multinomial(q, 1, generator=g).squeeze(1))
    return dict(
        logits=logits, q=q, drafts=drafts,
        n=torch.full((batch,), k, dtype=torch.int64, device=device),
        temperature=torch.full((batch,), 0.8, device=device),
        ua=torch.rand(num_drafts, generator=g, device=device),
        us=torch.rand(batch, generator=g, device=device),
    )


def run(args) -> list[dict]:
    from adaptspec.engine.sampling import logits_to_probs
    from adaptspec.engine.verifier import verify_greedy, verify_stochastic

    kv, device = load_kernels(args.device)
    dtype = getattr(torch, args.dtype)
    rows = []
    for vocab in args.vocab:
        for batch in args.batch:
            for k in args.k:
                x = _inputs(batch, k, vocab, device, dtype)
                temp_rows = torch.full((batch * (k + 1),), 0.8, device=device)
                no_k = torch.zeros(batch * (k + 1), dtype=torch.int64, device=device)
                no_p = torch.ones(batch * (k + 1), device=device)
                cases = {
                    "greedy": (
                        lambda: verify_greedy(x["logits"], x["drafts"], x["n"]),
                        lambda: kv.greedy_verify(x["logits"], x["drafts"], x["n"], max_num_draft_tokens=k),
                    ),
                    "stochastic": (
                        lambda: verify_stochastic(logits_to_probs(x["logits"], temp_rows, no_k, no_p),
                                                  x["drafts"], x["q"], x["n"], x["ua"], x["us"]),
                        lambda: kv.stochastic_verify_from_logits(
                            x["logits"], x["temperature"], x["drafts"], x["q"], x["n"], x["ua"], x["us"],
                            max_num_draft_tokens=k),
                    ),
                }
                for mode, (torch_fn, triton_fn) in cases.items():
                    ref, got = torch_fn(), triton_fn()
                    same = (ref.output_token_ids == got[0]).all(1).float().mean().item()
                    t_torch = _time_ms(torch_fn, device, args.iters, args.warmup)
                    t_triton = _time_ms(triton_fn, device, args.iters, args.warmup)
                    rows.append(dict(mode=mode, batch=batch, k=k, vocab=vocab, torch_ms=t_torch,
                                     triton_ms=t_triton, speedup=t_torch / t_triton, same=same,
                                     mean_accepted=ref.num_accepted.float().mean().item()))
                    print(_fmt(rows[-1]), flush=True)
                del x
                if device == "cuda":
                    torch.cuda.empty_cache()
    return rows


HEADER = f"{'mode':<11}{'batch':>6}{'k':>3}{'vocab':>8}{'torch ms':>10}{'triton ms':>11}{'speedup':>9}{'same':>6}"


def _fmt(r: dict) -> str:
    return (f"{r['mode']:<11}{r['batch']:>6}{r['k']:>3}{r['vocab']:>8}{r['torch_ms']:>10.3f}"
            f"{r['triton_ms']:>11.3f}{r['speedup']:>8.2f}x{r['same']:>6.2f}")


def machine(device: str) -> dict:
    import triton

    info = dict(torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                cpu=platform.processor() or platform.machine())
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m adaptspec.tools.kernel_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", metavar="PATH", help="also write the rows and the machine to PATH")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu with tiny sizes)")
    print(HEADER, flush=True)
    rows = run(args)
    info = machine(args.device)
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=info, dtype=args.dtype, iters=args.iters, rows=rows), f, indent=2)
    return rows


if __name__ == "__main__":
    main()
