"""`adaptspec bench-prefix`: time to first token with a shared prefix, cached and not.

Pairs of requests share a long prefix (a system prompt or a document) and differ in the
question after it. The first request of a pair computes the prefix; the second finds its
full blocks in the prefix cache. Reported: the second's TTFT over the first's, per pair and
as the median, with prefix caching on and (the control) off, in one run, alternating.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import typer


def _pairs(tokenizer, prefix_tokens: int, n: int) -> list[tuple[list[int], list[int]]]:
    """``n`` pairs of prompts (token ids): a distinct prefix of ``prefix_tokens`` per pair."""
    from adaptspec.serve.loadtest import bench_prompts

    words = [w for ps in bench_prompts().values() for p in ps for w in p.split()]
    out = []
    for i in range(n):
        ids: list[int] = []
        j = i * 997
        while len(ids) < prefix_tokens:
            ids += tokenizer(" ".join(words[(j + t) % len(words)] for t in range(64)), add_special_tokens=False)[
                "input_ids"]
            j += 64
        prefix = ids[:prefix_tokens]
        qa = tokenizer(f"\nQuestion {i}: what is this text about?", add_special_tokens=False)["input_ids"]
        qb = tokenizer(f"\nQuestion {i}: list three words from it.", add_special_tokens=False)["input_ids"]
        out.append((prefix + qa, prefix + qb))
    return out


def bench_prefix(
    target: str = typer.Option("smollm2-135m", help="target model"),
    dtype: str = typer.Option("float32"),
    prefix_tokens: int = typer.Option(512, help="tokens the two requests of a pair share"),
    pairs: int = typer.Option(6, help="pairs (each with its own prefix)"),
    json_path: str = typer.Option(None, "--json", help="write the results here"),
) -> None:
    """TTFT of a request whose prefix an earlier one computed, over that earlier one's."""
    from rich.console import Console

    from adaptspec import Engine, SamplingParams

    con = Console()
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    engines = {on: Engine.from_pretrained(target, dtype=dtype, enable_prefix_caching=on,
                                          max_model_len=max(2048, prefix_tokens + 64)) for on in (True, False)}
    tok = engines[True].tokenizer
    for e in engines.values():  # warm-up: kernels built, caches touched
        e.generate([_pairs(tok, 64, 1)[0][0]], params)
    ratios: dict[bool, list[float]] = {True: [], False: []}
    cached: list[int] = []
    for i, (a, b) in enumerate(_pairs(tok, prefix_tokens, pairs)):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            e = engines[on]
            first = e.generate([a], params, raw=True)[0]
            second = e.generate([b], params, raw=True)[0]
            ratios[on].append(second.ttft_s / first.ttft_s)
            if on:
                cached.append(second.stats.cached_prompt_tokens)
            con.print(f"pair {i} caching {'on ' if on else 'off'}: TTFT {first.ttft_s * 1e3:.0f} ms then "
                      f"{second.ttft_s * 1e3:.0f} ms (ratio {ratios[on][-1]:.3f}; "
                      f"{second.stats.cached_prompt_tokens} prompt tokens from the cache)")
    res = {"target": target, "dtype": dtype, "prefix_tokens": prefix_tokens, "pairs": pairs,
           "date": time.strftime("%Y-%m-%d %H:%M"),
           "ratio_median_caching_on": statistics.median(ratios[True]),
           "ratio_median_caching_off": statistics.median(ratios[False]),
           "ratios_on": ratios[True], "ratios_off": ratios[False], "cached_prompt_tokens": cached}
    con.print(f"second / first TTFT, median of {pairs} pairs: caching on {res['ratio_median_caching_on']:.3f}, "
              f"off {res['ratio_median_caching_off']:.3f} (the goal: on <= 0.25)")
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=2))
        con.print(f"wrote {json_path}")


def register(app: typer.Typer) -> None:
    app.command("bench-prefix")(bench_prefix)
