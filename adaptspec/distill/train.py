"""Knowledge distillation of a draft on the target's own continuations.

Both kinds learn the target's full next-token distribution at every continuation position
(the target's features and logits are recomputed on the fly from the token ids, on the
same device, under ``torch.no_grad``):

* ``head``: ``DraftHead`` (``head.py``) with ``passes`` unrolled drafting steps;
* ``model``: an independent Llama-family model with the target's tokenizer, by default its
  first ``layers`` layers as a warm start (the target's embedding is frozen and tied).

Losses (per position, between the target's p and the draft's q):
``kl`` = forward KL(p || q) (cross-entropy up to p's entropy), ``tv`` = total variation
(1 - TV is the acceptance probability of exact speculative sampling at temperature 1),
``mix`` = kl + tv. With a reduced draft vocabulary V, q is 0 outside V: the KL sums over V
and TV counts p's mass outside V as lost.

The learning rate follows a cosine over the time budget (or the step budget), so a run
stopped by its budget has annealed. Checkpoints (``ckpt.pt``) hold the weights, the
optimizer, the data order and the curve; ``resume=True`` continues from one.
"""
from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from adaptspec.distill.data import Dataset, Example
from adaptspec.models.llama import LlamaModel

LOSSES = ("kl", "tv", "mix")


@dataclass(slots=True)
class TrainConfig:
    kind: str = "head"  # head | model
    layers: int = 1
    hidden: int | None = None  # model kind: hidden size (default: the target's)
    vocab_top: int | None = None  # head kind: reduced draft vocabulary size
    loss: str = "mix"
    passes: int = 3  # head kind: unrolled drafting steps in training
    lr: float = 1e-3
    weight_decay: float = 0.0
    batch_tokens: int = 4096
    max_len: int = 576
    steps: int | None = None  # stop after this many steps (None: time budget / epochs)
    epochs: float = 100.0
    time_budget_s: float | None = None
    warmup_steps: int = 30
    eval_every_s: float = 60.0
    eval_every_steps: int | None = None
    checkpoint_every_s: float = 120.0
    max_train_tokens: int | None = None  # use only the first N continuation tokens of the data
    seed: int = 0
    init: str = "target"  # target | random

    def __post_init__(self) -> None:
        if self.kind not in ("head", "model"):
            raise ValueError(f"kind: must be 'head' or 'model', got {self.kind!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss: must be one of {LOSSES}, got {self.loss!r}")
        if self.layers < 1:
            raise ValueError(f"layers: must be >= 1, got {self.layers}")
        if self.kind == "model" and self.vocab_top:
            raise ValueError("vocab_top: a reduced vocabulary applies to --kind head only (a model draft's "
                             "output layer is tied to its embedding)")
        if self.passes < 1:
            raise ValueError(f"passes: must be >= 1, got {self.passes}")
        if self.init not in ("target", "random"):
            raise ValueError(f"init: must be 'target' or 'random', got {self.init!r}")


# ---- batching ---------------------------------------------------------------------------
def _batches(examples: list[Example], batch_tokens: int, max_len: int, rng: random.Random) -> list[list[int]]:
    """Length-bucketed batches of about ``batch_tokens`` padded tokens."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].ids), rng.random()))
    out, cur, cur_max = [], [], 0
    for i in order:
        n = min(len(examples[i].ids), max_len)
        if cur and max(cur_max, n) * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def _pad(examples: list[Example], idx: list[int], max_len: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, L], lens [B], loss mask [B, L] (True where position t predicts a continuation token)."""
    seqs = [examples[i] for i in idx]
    L = min(max(len(e.ids) for e in seqs), max_len)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.bool)
    lens = []
    for r, e in enumerate(seqs):
        x = e.ids[-L:] if len(e.ids) > L else e.ids  # keep the end: the continuation
        cut = len(e.ids) - len(x)
        ids[r, :len(x)] = torch.tensor(x)
        first = max(e.prompt_len - 1 - cut, 0)  # position prompt_len-1 predicts the first output token
        mask[r, first:len(x) - 1] = True
        lens.append(len(x))
    return ids.to(device), torch.tensor(lens, device=device), mask.to(device)


class TargetTeacher:
    """The target on our paged-KV forward: features and distributions of whole sequences."""

    BLOCK = 16

    def __init__(self, model: LlamaModel, max_rows: int, max_len: int):
        self.model = model
        self.rows, self.len = 0, 0
        self._ensure(max_rows, max_len)

    def _ensure(self, rows: int, length: int) -> None:
        if rows > self.rows or length > self.len:
            self.rows, self.len = max(rows, self.rows), max(length, self.len)
            self.model.allocate_kv(self.rows * -(-self.len // self.BLOCK), self.BLOCK)

    @torch.no_grad()
    def features(self, ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        from adaptspec.models.batch import FlatBatch

        B, L = ids.shape
        self._ensure(B, L)
        n = -(-self.len // self.BLOCK)
        lens_l = lens.tolist()
        rows = [ids[b, :lens_l[b]].tolist() for b in range(B)]
        batch = FlatBatch.build(rows, [0] * B, [list(range(b * n, (b + 1) * n)) for b in range(B)], [],
                                self.BLOCK, ids.device)
        _, flat = self.model.forward(batch)  # [sum(lens), H], normed
        hidden = torch.zeros(B, L, flat.shape[1], dtype=flat.dtype, device=flat.device)
        mask = torch.arange(L, device=ids.device)[None, :] < lens[:, None]
        hidden[mask] = flat
        return hidden  # [B, L, H], zeros past each row's length

    @torch.no_grad()
    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        return self.model._mm(feats.to(self.model.compute_dtype), self.model.lm_head).float()


def _loss(kind: str, t_logp: torch.Tensor, s_logits: torch.Tensor, vocab_ids: torch.Tensor | None):
    """Per-position loss, greedy agreement and 1 - TV. ``t_logp`` [N, vocab] (full),
    ``s_logits`` [N, |V|]."""
    s_logq = torch.log_softmax(s_logits.float(), -1)
    p_v = t_logp.exp() if vocab_ids is None else t_logp.index_select(1, vocab_ids).exp()
    q = s_logq.exp()
    kl = -(p_v * s_logq).sum(-1)
    tv = 0.5 * (p_v - q).abs().sum(-1) + 0.5 * (1 - p_v.sum(-1)).clamp(min=0)
    loss = {"kl": kl, "tv": tv, "mix": kl + tv}[kind]
    s_arg = s_logits.argmax(-1)
    if vocab_ids is not None:
        s_arg = vocab_ids[s_arg]
    agree = (s_arg == t_logp.argmax(-1)).float()
    return loss, agree, 1 - tv.detach()


# ---- the trainer ----------------------------------------------------------------------
@dataclass(slots=True)
class CurvePoint:
    step: int
    elapsed_s: float
    tokens_seen: int  # continuation positions trained on, with repeats
    unique_tokens: int  # distinct continuation positions seen so far
    train_loss: float
    held_out: dict  # alpha per pass / class, acceptance at T=1


@dataclass(slots=True)
class TrainState:
    step: int = 0
    elapsed_s: float = 0.0
    tokens_seen: int = 0
    seen: set = field(default_factory=set)
    curve: list = field(default_factory=list)
    best_alpha: float = -1.0


class Trainer:
    def __init__(self, target_weights: dict[str, torch.Tensor], target_model: LlamaModel, tcfg_hf,
                 cfg: TrainConfig, data: Dataset, held_out: Dataset, out: Path, device, console: Console | None = None,
                 target_name: str = ""):
        self.cfg, self.out, self.device = cfg, Path(out), torch.device(device)
        self.con = console or Console()
        self.data = data if cfg.max_train_tokens is None else _prefix(data, cfg.max_train_tokens)
        self.held = held_out
        self.teacher = TargetTeacher(target_model, 8, cfg.max_len)
        self.tcfg_hf = tcfg_hf
        self.target_name = target_name
        torch.manual_seed(cfg.seed)
        tcfg = target_model.cfg
        tie = tcfg.tie_word_embeddings
        embed = target_weights["model.embed_tokens.weight"].float()
        out_full = embed if tie else target_weights["lm_head.weight"].float()
        if cfg.kind == "head":
            from adaptspec.distill.head import DraftHead, HeadConfig

            n = cfg.vocab_top or tcfg.vocab_size
            vocab_ids = _top_tokens(self.data, n, tcfg.vocab_size)
            hc = HeadConfig.for_target(tcfg, cfg.layers, n)
            hc.target = {"name": target_name, "vocab_size": tcfg.vocab_size, "hidden_size": tcfg.hidden_size,
                         "num_layers": tcfg.num_layers}
            self.student = DraftHead(hc, embed, out_full.index_select(0, vocab_ids), vocab_ids)
            if cfg.init == "target":
                self.student.init_from_target_layers(target_weights, tcfg.num_layers - cfg.layers)
            self.vocab_ids = self.student.vocab_ids.to(self.device)
            self.coverage = _coverage(self.data, vocab_ids)
        else:
            self.student = _make_model_student(target_weights, tcfg_hf, cfg)
            self.vocab_ids = None
            self.coverage = 1.0
        self.student.to(self.device)
        params = [p for p in self.student.parameters() if p.requires_grad]
        self.num_params = sum(p.numel() for p in params)
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.state = TrainState()
        self.rng = random.Random(cfg.seed)
        # bf16 autocast on CUDA (ADAPTSPEC_DISTILL_AUTOCAST=1 forces it on the CPU, to test that path)
        import os

        self.autocast = self.device.type == "cuda" or os.environ.get("ADAPTSPEC_DISTILL_AUTOCAST") == "1"

    # -- one batch ------------------------------------------------------------------
    def _forward(self, ids, lens, mask):
        feats = self.teacher.features(ids, lens).clone().float()  # [B, L, H]; clone: out of inference mode
        sel = mask.nonzero(as_tuple=True)
        with torch.no_grad():
            t_logp = torch.log_softmax(self.teacher.logits(feats[sel]), -1)  # [N, vocab], position t -> x_{t+1}
        ctx = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()
        with ctx:
            if self.cfg.kind == "head":
                # head entry j (feature f_j, token x_{j+1}) predicts x_{j+2}: the target's p at position j+1
                passes = self.student(feats, ids, self.cfg.passes)
                hmask = mask[:, 1:]  # entry j predicts what position j+1 predicts
                hsel = hmask.nonzero(as_tuple=True)
                tsel = (hsel[0], hsel[1] + 1)
                t_map = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
                t_map[sel] = torch.arange(sel[0].numel(), device=mask.device)
                t_rows = t_map[tsel]
                out = []
                for s, g in enumerate(passes, start=1):
                    valid = hsel[1] >= s - 1
                    logits = self.student.logits(g[hsel][valid])
                    out.append(_loss(self.cfg.loss, t_logp[t_rows[valid]], logits, self.vocab_ids))
            else:
                logits = self.student(input_ids=ids, attention_mask=_attn_mask(lens, ids.shape[1])).logits
                out = [_loss(self.cfg.loss, t_logp, logits[sel], None)]
        return out, mask[:, 1:].sum().item() if self.cfg.kind == "head" else mask.sum().item()

    # -- evaluation -----------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        self.student.eval()
        acc: dict[str, dict[str, list[float]]] = {}
        batches = _batches(self.held.examples, self.cfg.batch_tokens, self.cfg.max_len, random.Random(0))
        for b in batches:
            greedy = [i for i in b if self.held.examples[i].greedy]
            if not greedy:
                continue
            ids, lens, mask = _pad(self.held.examples, greedy, self.cfg.max_len, self.device)
            outs, _ = self._forward(ids, lens, mask)
            # per example class: count agreement per pass
            if self.cfg.kind == "head":
                hsel = mask[:, 1:].nonzero(as_tuple=True)[0]
            else:
                hsel = mask.nonzero(as_tuple=True)[0]
            for s, (_, agree, accept) in enumerate(outs, start=1):
                rows = hsel
                if self.cfg.kind == "head":
                    rows = hsel[mask[:, 1:].nonzero(as_tuple=True)[1] >= s - 1]
                for r, a, t in zip(rows.tolist(), agree.tolist(), accept.tolist()):
                    cls = self.held.examples[greedy[r]].request_class
                    d = acc.setdefault(cls, {})
                    d.setdefault(f"alpha{s}", []).append(a)
                    d.setdefault(f"accept{s}", []).append(t)
        self.student.train()
        res: dict = {"per_class": {}}
        for cls, d in sorted(acc.items()):
            res["per_class"][cls] = {k: sum(v) / len(v) for k, v in d.items()}
        for key in ("alpha1", "alpha2", "alpha3", "accept1"):
            vals = [x for d in acc.values() for x in d.get(key, [])]
            if vals:
                res[key] = sum(vals) / len(vals)
        # the headline: class-balanced alpha at the first drafted position
        per = [v["alpha1"] for v in res["per_class"].values() if "alpha1" in v]
        res["alpha"] = sum(per) / len(per) if per else 0.0
        return res

    # -- the loop -------------------------------------------------------------------
    def _lr(self) -> float:
        c, s = self.cfg, self.state
        warm = min(1.0, (s.step + 1) / max(1, c.warmup_steps))
        if c.time_budget_s:
            frac = min(1.0, s.elapsed_s / c.time_budget_s)
        elif c.steps:
            frac = min(1.0, s.step / c.steps)
        else:
            frac = 0.0
        return c.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    def _done(self) -> bool:
        c, s = self.cfg, self.state
        if c.steps is not None and s.step >= c.steps:
            return True
        if c.time_budget_s is not None and s.elapsed_s >= c.time_budget_s:
            return True
        total = max(1, sum(max(0, e.num_output - 1) for e in self.data.examples))
        return s.tokens_seen >= c.epochs * total

    def train(self, resume: bool = False) -> TrainState:
        ck = self.out / "ckpt.pt"
        if resume and ck.is_file():
            self._load(ck)
            self.con.print(f"resumed from {ck} at step {self.state.step} ({self.state.elapsed_s:.0f} s trained)")
        if not self.data.examples:
            raise ValueError("no training data: generate some first (--tokens)")
        s, c = self.state, self.cfg
        last_eval, last_ck = time.perf_counter(), time.perf_counter()
        epoch_rng = random.Random(c.seed + s.step)
        if not s.curve:
            self._eval_point(0.0)
        total = c.time_budget_s or None
        with Progress(TextColumn("[bold]distill {task.fields[kind]}"), BarColumn(), TextColumn("{task.fields[info]}"),
                      TimeElapsedColumn(), console=self.con) as prog:
            task = prog.add_task("train", total=total or c.steps or 1, kind=c.kind, info="")
            losses: list[float] = []
            while not self._done():
                for b in _batches(self.data.examples, c.batch_tokens, c.max_len, epoch_rng):
                    if self._done():
                        break
                    t0 = time.perf_counter()
                    ids, lens, mask = _pad(self.data.examples, b, c.max_len, self.device)
                    outs, n_pos = self._forward(ids, lens, mask)
                    weights = [0.8 ** i for i in range(len(outs))]
                    loss = sum(w * o[0].mean() for w, o in zip(weights, outs)) / sum(weights)
                    for g in self.opt.param_groups:
                        g["lr"] = self._lr()
                    self.opt.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(self.student.parameters(), 1.0)
                    self.opt.step()
                    s.step += 1
                    s.tokens_seen += n_pos
                    s.seen.update(b)
                    losses.append(float(loss.detach()))
                    if self.device.type == "cuda":
                        torch.cuda.synchronize()
                    s.elapsed_s += time.perf_counter() - t0
                    now = time.perf_counter()
                    due = (c.eval_every_steps and s.step % c.eval_every_steps == 0) or (
                        not c.eval_every_steps and now - last_eval > c.eval_every_s)
                    if due:
                        self._eval_point(sum(losses[-50:]) / len(losses[-50:]))
                        last_eval = time.perf_counter()
                    if now - last_ck > c.checkpoint_every_s:
                        self._save(ck)
                        last_ck = time.perf_counter()
                    last = s.curve[-1]["held_out"] if s.curve else {}
                    prog.update(task, completed=s.elapsed_s if total else s.step,
                                info=f"step {s.step}  loss {losses[-1]:.3f}  held-out alpha {last.get('alpha', 0):.3f}")
        self._eval_point(sum(losses[-50:]) / max(1, len(losses[-50:])) if losses else 0.0)
        self._save(ck)
        return s

    def _eval_point(self, train_loss: float) -> None:
        s = self.state
        ev = self.evaluate()
        uniq = sum(max(0, self.data.examples[i].num_output - 1) for i in s.seen)
        s.curve.append(asdict(CurvePoint(s.step, round(s.elapsed_s, 2), s.tokens_seen, uniq,
                                         round(train_loss, 4), ev)))
        self.con.print(f"  step {s.step:>6}  {s.elapsed_s:7.1f}s  seen {s.tokens_seen:>10,} tok  "
                       f"loss {train_loss:.3f}  held-out alpha {ev['alpha']:.3f} "
                       + " ".join(f"{k}={v['alpha1']:.2f}" for k, v in ev["per_class"].items()))
        if ev["alpha"] > s.best_alpha:
            s.best_alpha = ev["alpha"]
            self.best_state = {k: v.detach().clone() for k, v in self.student.state_dict().items()}

    def _save(self, path: Path) -> None:
        s = self.state
        tmp = Path(str(path) + ".tmp")
        torch.save({"student": self.student.state_dict(), "opt": self.opt.state_dict(),
                    "state": {"step": s.step, "elapsed_s": s.elapsed_s, "tokens_seen": s.tokens_seen,
                              "seen": sorted(s.seen), "curve": s.curve, "best_alpha": s.best_alpha},
                    "best": getattr(self, "best_state", None), "config": asdict(self.cfg)}, tmp)
        tmp.replace(path)

    def _load(self, path: Path) -> None:
        ck = torch.load(path, weights_only=False, map_location=self.device)
        if ck["config"]["kind"] != self.cfg.kind or ck["config"]["layers"] != self.cfg.layers:
            raise ValueError(f"resume: {path} holds a {ck['config']['kind']} draft with {ck['config']['layers']} "
                             "layers; start a new --out or pass the same --kind/--layers")
        self.student.load_state_dict(ck["student"])
        self.opt.load_state_dict(ck["opt"])
        st = ck["state"]
        self.state = TrainState(st["step"], st["elapsed_s"], st["tokens_seen"], set(st["seen"]), st["curve"],
                                st["best_alpha"])
        if ck.get("best") is not None:
            self.best_state = ck["best"]

    def use_best(self) -> None:
        if getattr(self, "best_state", None) is not None:
            self.student.load_state_dict(self.best_state)


# ---- helpers ----------------------------------------------------------------------------
def _attn_mask(lens: torch.Tensor, L: int) -> torch.Tensor:
    return (torch.arange(L, device=lens.device)[None, :] < lens[:, None]).long()


def _prefix(data: Dataset, tokens: int) -> Dataset:
    out, n = [], 0
    for e in data.examples:
        if n >= tokens:
            break
        out.append(e)
        n += e.num_output
    return Dataset(out, data.next_prompt, data.gen_seconds)


def _top_tokens(data: Dataset, n: int, vocab: int) -> torch.Tensor:
    """The n most frequent tokens of the target's own continuations (ties by id), sorted."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for e in data.examples:
        counts += torch.bincount(torch.tensor(e.ids[e.prompt_len:], dtype=torch.long), minlength=vocab)
    if n >= vocab:
        return torch.arange(vocab)
    order = torch.argsort(counts * vocab + (vocab - 1 - torch.arange(vocab)), descending=True)
    return order[:n].sort().values


def _coverage(data: Dataset, vocab_ids: torch.Tensor) -> float:
    keep = set(vocab_ids.tolist())
    tot = hit = 0
    for e in data.examples:
        out = e.ids[e.prompt_len:]
        tot += len(out)
        hit += sum(1 for t in out if t in keep)
    return hit / max(1, tot)


def _make_model_student(weights: dict[str, torch.Tensor], tcfg_hf, cfg: TrainConfig):
    """An independent Llama model: the target's first ``layers`` layers (init "target") or a
    random one of width ``hidden``; the embedding (tied output layer) stays frozen."""
    from transformers import AutoModelForCausalLM

    hf = tcfg_hf.to_dict()
    hidden = cfg.hidden or hf["hidden_size"]
    hf.update(num_hidden_layers=cfg.layers, tie_word_embeddings=True)
    if hidden != hf["hidden_size"]:
        ratio = hidden / hf["hidden_size"]
        heads = max(1, round(hf["num_attention_heads"] * ratio))
        while hidden % heads:
            heads -= 1
        kv = max(1, min(heads, hf.get("num_key_value_heads", heads)))
        while heads % kv:
            kv -= 1
        hf.update(hidden_size=hidden, intermediate_size=int(hf["intermediate_size"] * ratio) // 8 * 8,
                  num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads)
    for k in ("quantization_config", "_name_or_path", "transformers_version", "architectures"):
        hf.pop(k, None)
    cfg_cls = type(tcfg_hf)
    student = AutoModelForCausalLM.from_config(cfg_cls(**hf))
    embed = weights["model.embed_tokens.weight"].float()
    with torch.no_grad():
        if hidden == tcfg_hf.hidden_size:
            student.model.embed_tokens.weight.copy_(embed)
            if cfg.init == "target":
                sd = {k: v for k, v in weights.items() if k.startswith("model.layers.")
                      and int(k.split(".")[2]) < cfg.layers}
                sd["model.norm.weight"] = weights["model.norm.weight"]
                student.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
        else:  # PCA of the target's embedding onto `hidden` dimensions
            centred = embed - embed.mean(0)
            _, _, v = torch.pca_lowrank(centred, q=hidden, center=False)
            proj = embed @ v[:, :hidden]
            student.model.embed_tokens.weight.copy_(proj / proj.std() * embed.std())
    student.model.embed_tokens.weight.requires_grad_(False)
    student.tie_weights()
    return student.float()
