"""`adaptspec distill --source sharegpt`: an EAGLE-3 head for a target, resumable on a CPU.

Phases, each resumable and skipped once done (everything under ``run``, by default
``$ADAPTSPEC_HOME/distill/<name>``):

1. ``generate``: on-policy answers. The target decodes (greedy, our engine, no
   speculation) the first user turn of ShareGPT conversations plus code-edit and
   extraction prompts from the offline corpus (``corpus.py``); held-out prompts alike.
   Files ``onpolicy.pt`` / ``held_out.pt`` (``data.Dataset``).
2. ``features``: teacher-forced prefills (transformers, ``output_hidden_states``) of the
   on-policy sequences and of whole ShareGPT conversations (off-policy, the assistant
   turns as targets), stored as shards (``features.FeatureStore``): the fused features the
   head reads and the target's final hidden state for its distribution.
3. ``train``: the head (``shard_train``) over the shards; checkpoints, a held-out curve.
4. ``export``: the best head as a draft folder, ``curve.png``, ``summary.json``.

Long phases show a tqdm bar with an ETA; stopping (Ctrl-C, a kill) loses at most the
work since the last save, and the same command continues.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

PHASES = ("generate", "features", "train", "export")


@dataclass(slots=True)
class Plan:
    run: Path
    target: str = "smollm2-135m"
    dtype: str = "bfloat16"  # the target's, for generation and features
    onpolicy_tokens: int = 200_000  # greedy answer tokens of the target (training)
    held_out_tokens: int = 20_000  # greedy answer tokens of held-out prompts
    offpolicy_tokens: int = 200_000  # ShareGPT assistant tokens, teacher-forced
    max_new_tokens: int = 160
    max_prompt_tokens: int = 384
    max_len: int = 512  # tokens per feature sequence
    gen_batch: int = 32
    corpus_share: float = 0.4  # share of on-policy prompts from the offline corpus (code edit, extraction)
    feature_layers: list[int] | None = None  # None: EAGLE-3's default for the target
    seed: int = 0
    train: dict = field(default_factory=dict)  # shard_train.ShardTrainConfig fields

    def __post_init__(self) -> None:
        self.run = Path(self.run)
        for name in ("onpolicy_tokens", "held_out_tokens", "offpolicy_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.corpus_share <= 1.0:
            raise ValueError(f"corpus_share: must be in [0, 1], got {self.corpus_share}")
        if self.max_len < 16:
            raise ValueError(f"max_len: must be >= 16, got {self.max_len}")


def onpolicy_order(train_prompts: list[str], corpus_train: dict[str, list[str]], share: float,
                   seed: int) -> list[tuple[str, str]]:
    """(class, prompt) pairs: ShareGPT prompts as ``chat`` and, a ``share`` of the time,
    corpus code-edit / extraction prompts, alternating; deterministic for a seed."""
    rng = random.Random(seed)
    chat = list(train_prompts)
    rng.shuffle(chat)
    other = {c: list(v) for c, v in corpus_train.items() if c != "chat"}
    for v in other.values():
        rng.shuffle(v)
    names = sorted(other)
    out, acc, turn = [], 0.0, 0
    idx = {c: 0 for c in names}
    for p in chat:
        out.append(("chat", p))
        acc += share / max(1e-9, 1 - share) if share < 1 else 1.0
        while acc >= 1.0 and names:
            c = names[turn % len(names)]
            turn += 1
            if idx[c] < len(other[c]):
                out.append((c, other[c][idx[c]]))
                idx[c] += 1
            acc -= 1.0
    return out


def _prompts(plan: Plan):
    from adaptspec.distill import sharegpt
    from adaptspec.distill.corpus import build_corpus

    convs = list(sharegpt.read_conversations(sharegpt.wheel_path()))
    train, held = sharegpt.split(convs)
    corpus = build_corpus(plan.seed)
    order = onpolicy_order([c.first_prompt for c in train], corpus.train, plan.corpus_share, plan.seed)
    held_order = onpolicy_order([c.first_prompt for c in held],
                                {c: v[:60] for c, v in corpus.held_out.items()}, plan.corpus_share, plan.seed + 1)
    return train, held, order, held_order


def generate_phase(plan: Plan, console=None) -> None:
    from adaptspec.distill.data import generate
    from adaptspec.engine.engine import Engine, EngineConfig
    from adaptspec.engine.params import MAX_K
    from adaptspec.models.loader import load_model

    plan.run.mkdir(parents=True, exist_ok=True)
    _, _, order, held_order = _prompts(plan)
    t = load_model(plan.target, dtype=plan.dtype, quiet=True)
    eng = Engine(t, None, EngineConfig(max_num_seqs=plan.gen_batch,
                                       max_model_len=plan.max_prompt_tokens + plan.max_new_tokens + MAX_K + 2))
    common = dict(samples=0, max_new_tokens=plan.max_new_tokens, max_prompt_tokens=plan.max_prompt_tokens,
                  console=console)
    generate(eng, {}, plan.run / "held_out.pt", tokens=plan.held_out_tokens, seed=plan.seed + 1,
             label="held-out answers", order=held_order, **common)
    generate(eng, {}, plan.run / "onpolicy.pt", tokens=plan.onpolicy_tokens, seed=plan.seed,
             label="on-policy answers", order=order, **common)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--plan", type=Path, help="a JSON file of Plan fields")
    a = ap.parse_args(argv)
    fields = json.loads(a.plan.read_text()) if a.plan else {}
    plan = Plan(run=a.run, **fields)
    phases = [p for p in a.phases.split(",") if p]
    bad = [p for p in phases if p not in PHASES]
    if bad:
        raise SystemExit(f"phases: unknown {bad} (have {PHASES})")
    (plan.run).mkdir(parents=True, exist_ok=True)
    (plan.run / "plan.json").write_text(json.dumps({k: (str(v) if isinstance(v, Path) else v)
                                                   for k, v in asdict(plan).items()}, indent=1) + "\n")
    t0 = time.perf_counter()
    if "generate" in phases:
        generate_phase(plan)
    print(f"done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
