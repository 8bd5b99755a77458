"""CLI commands of the engine area: `complete`, `bench`, `demo`."""
from __future__ import annotations

import json
from typing import Optional

import typer

from adaptspec.clierr import fail_cleanly


def register(app: typer.Typer) -> None:
    app.command("complete")(complete)
    app.command("bench")(bench)
    app.command("compare")(demo)  # `adaptspec demo` is the service demo (adaptspec.serve.cli)


@fail_cleanly
def complete(
    prompt: str = typer.Argument(..., help="prompt text (chat template applied unless --raw)"),
    target: str = typer.Option("smollm2-135m", help="target model: alias, folder, .gguf or hub id"),
    draft: Optional[str] = typer.Option(None, help="draft model (needed for --drafter draft)"),
    drafter: str = typer.Option("ngram", help="none | ngram | draft"),
    k: int = typer.Option(4, help="candidates per step (0..16); 0 = plain decoding"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    max_new_tokens: int = typer.Option(64),
    seed: Optional[int] = typer.Option(None),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="stop string (repeatable); cut from the text"),
    dtype: str = typer.Option("float32", help="float32 | bfloat16"),
    device: str = typer.Option("cpu"),
    raw: bool = typer.Option(False, help="do not apply the chat template"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object {text, token_ids, stats}"),
) -> None:
    """Complete one prompt with speculative decoding."""
    from adaptspec import Engine, SamplingParams, SpecConfig
    from adaptspec.models.registry import DEFAULT_DRAFT

    spec = SpecConfig(drafter, k if drafter != "none" else 0)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=list(stop or []))
    if drafter == "draft" and draft is None:
        draft = DEFAULT_DRAFT
    engine = Engine.from_pretrained(target, draft=draft if drafter == "draft" else None, dtype=dtype,
                                    device=device, max_num_seqs=1)
    out = engine.generate([prompt], params, spec, raw=raw)[0]
    if as_json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "stats": out.stats.as_dict()}))
        return
    from rich.console import Console

    st = out.stats
    Console().print(out.text, markup=False, highlight=False)
    Console(stderr=True).print(
        f"[dim]{len(out.token_ids)} tokens in {st.wall_s:.2f}s ({len(out.token_ids) / max(st.wall_s, 1e-9):.1f} tok/s), "
        f"drafter={drafter} k={spec.k}, acceptance {st.acceptance_rate:.2f}, "
        f"mean accepted length {st.mean_accepted_length:.2f}[/]")


@fail_cleanly
def bench(
    target: str = typer.Option("smollm2-135m"),
    draft: Optional[str] = typer.Option(None, help="draft(s), comma-separated (models or draft heads); "
                                        "default: the built-in default draft"),
    drafters: str = typer.Option("ngram,draft", help="our drafters to measure (ngram, draft)"),
    dtype: str = typer.Option("float32,bfloat16", help="comma-separated dtypes"),
    batch: str = typer.Option("1,8", help="comma-separated batch sizes"),
    k: str = typer.Option("1,2,4,8", help="comma-separated k values for our drafters"),
    classes: str = typer.Option("", help="comma-separated classes (default: all in the prompt set)"),
    max_new_tokens: int = typer.Option(48),
    prompts_per_class: int = typer.Option(8),
    repeats: int = typer.Option(1, help="rounds over each class's prompts, every method in each round "
                                "(a noisy machine: more rounds, steadier ratios)"),
    no_hf: bool = typer.Option(False, "--no-hf", help="skip the transformers baselines"),
    device: str = typer.Option("cpu"),
    json_path: Optional[str] = typer.Option(None, "--json", help="write all results to this JSON file"),
) -> None:
    """Benchmark plain vs speculative decoding against transformers (tokens/s, acceptance, bound)."""
    from adaptspec.tools.bench import BenchConfig, run_bench

    cfg = BenchConfig(target=target, drafts=_csv(draft or ""), drafters=_csv(drafters), dtypes=_csv(dtype), batches=[int(x) for x in _csv(batch)],
                      ks=[int(x) for x in _csv(k)], classes=_csv(classes), max_new_tokens=max_new_tokens,
                      prompts_per_class=prompts_per_class, repeats=repeats, hf=not no_hf, device=device)
    run_bench(cfg, json_path)


@fail_cleanly
def demo(
    max_new_tokens: int = typer.Option(64),
    dtype: str = typer.Option("float32"),
) -> None:
    """Pull the default models and decode the same prompts plainly and speculatively, side by side."""
    from adaptspec.tools.compare import run_demo

    run_demo(max_new_tokens=max_new_tokens, dtype=dtype)


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]
