"""A short side-by-side demo: the same prompts decoded plainly and speculatively."""
from __future__ import annotations

import time

from rich.table import Table

from adaptspec.clierr import console as _console

DEMO_PROMPTS = {
    "code_edit": "Add type hints to this function and return the full code:\n\n"
                 "def merge(a, b):\n    out = dict(a)\n    for key, value in b.items():\n"
                 "        out[key] = value\n    return out\n",
    "chat": "Give me two tips for writing clear emails.",
}


def run_demo(max_new_tokens: int = 64, dtype: str = "float32") -> None:
    from adaptspec import Engine, SamplingParams, SpecConfig
    from adaptspec.models.pull import pull
    from adaptspec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET

    con = _console()
    con.rule("AdaptSpec demo: plain vs speculative decoding (greedy, exact)")
    pull(DEFAULT_TARGET)
    pull(DEFAULT_DRAFT)
    t = time.perf_counter()
    engine = Engine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, dtype=dtype, max_num_seqs=1)
    con.print(f"loaded {DEFAULT_TARGET} (+ draft {DEFAULT_DRAFT}) in {time.perf_counter() - t:.1f}s, {dtype}, cpu")
    params = SamplingParams(max_new_tokens=max_new_tokens)
    engine.generate(["Hello"], SamplingParams(max_new_tokens=4))  # warm-up
    table = Table(title=f"{max_new_tokens} new tokens per prompt, batch 1")
    for col in ("class", "arm", "tokens/s", "speedup", "acceptance", "mean accepted length", "same tokens"):
        table.add_column(col)
    for cls, prompt in DEMO_PROMPTS.items():
        plain = None
        for spec in (SpecConfig(), SpecConfig("ngram", 4), SpecConfig("draft", 2)):
            t = time.perf_counter()
            out = engine.generate([prompt], params, spec)[0]
            tps = len(out.token_ids) / (time.perf_counter() - t)
            plain = plain or (out, tps)
            st = out.stats
            table.add_row(cls, f"{spec.drafter} k={spec.k}", f"{tps:.1f}", f"{tps / plain[1]:.2f}x",
                          f"{st.acceptance_rate:.2f}" if spec.k else "-", f"{st.mean_accepted_length:.2f}",
                          "yes" if out.token_ids == plain[0].token_ids else "NO")
        con.print(f"\n[bold]{cls}[/] prompt: {prompt.splitlines()[0]}")
        con.print(plain[0].text, markup=False, highlight=False)
    con.print(table)
    con.print(f"The draft is {DEFAULT_DRAFT}, the feature-level head distilled for this target (its model card: "
              "adaptspec/data/models/smollm2-135m-draft/README.md); run `adaptspec bench` for the full comparison.")
