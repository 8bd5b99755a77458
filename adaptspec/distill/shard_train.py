"""Training a draft head on stored target features (``features.FeatureStore``), and the
held-out acceptance it would reach when drafting.

The loss at every learned position is the cross-entropy of the head's draft-vocabulary
distribution q against the target's p restricted to the draft vocabulary (forward KL up
to p's entropy; p's mass outside the vocabulary counts as lost), summed over the
``passes`` unrolled drafting steps with weights 0.8^(s-1) ("training-time test"). The
target's p comes from the stored final hidden state: ``exp(final . W_out[V] - lse)``.

Held-out acceptance is measured by simulating greedy speculative decoding with ``k``
candidates over the target's own greedy answers: a step that has committed ``m`` tokens
drafts candidate ``i`` with pass ``i`` at entry ``m - 3 + i`` of the teacher-forced unroll
(the unroll computes exactly what drafting computes, see ``head.py``, as long as the earlier
candidates were right, and only then is candidate ``i`` judged); the accepted candidates
are the leading ones equal to the answer's tokens. This gives the engine's numbers
(accepted length, per-token acceptance ``a``) without running the engine.

Resumable: the checkpoint holds the head, the optimizer, the epoch, the batches done in
it and the curve; the epoch's batch plan is a function of the seed and the manifest.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from adaptspec.distill.features import FeatureStore


@dataclass(slots=True)
class ShardTrainConfig:
    layers: int = 1
    vocab_top: int = 8192
    passes: int = 3
    lr: float = 1e-3
    weight_decay: float = 0.0
    batch_tokens: int = 4096  # padded tokens per batch
    epochs: float = 4.0
    steps: int | None = None
    time_budget_s: float | None = None
    warmup_steps: int = 50
    eval_every_steps: int = 200
    checkpoint_every_s: float = 300.0
    eval_k: int = 4
    autocast: bool = True  # bf16 matmuls (CPUs with AVX512-BF16 and GPUs run them ~2x faster)
    init: str = "target"  # target (warm start from the target's last layer) | random
    arch: str = "eagle3"  # eagle3 (fused layers, the "aux" feature) | adaptspec (format 1: the final normed state)
    init_head: str | None = None  # a saved head (draft name or folder) to continue from: its weights and vocabulary
    sources: list[str] | None = None  # train on these shard sources only (e.g. ["onpolicy"]); None: all
    norm_before_fc: bool = True
    norm_before_residual: bool = True
    fc_norm: bool = False
    norm_output: bool = False
    buffer_shards: int = 4  # shards mixed into one window of batches
    seed: int = 0

    def __post_init__(self) -> None:
        if self.passes < 1 or self.layers < 1:
            raise ValueError(f"passes / layers: must be >= 1, got {self.passes} / {self.layers}")
        if self.init not in ("target", "random"):
            raise ValueError(f"init: must be 'target' or 'random', got {self.init!r}")
        if self.arch not in ("eagle3", "adaptspec"):
            raise ValueError(f"arch: must be 'eagle3' or 'adaptspec', got {self.arch!r}")
        if self.vocab_top < 1:
            raise ValueError(f"vocab_top: must be >= 1, got {self.vocab_top}")
        if self.batch_tokens < 16:
            raise ValueError(f"batch_tokens: must be >= 16, got {self.batch_tokens}")


# ---- batches ------------------------------------------------------------------------------
def epoch_plan(store: FeatureStore, epoch: int, batch_tokens: int, buffer_shards: int, seed: int,
               shards: list[int] | None = None) -> list[list[tuple[int, int]]]:
    """The epoch's batches as (shard, sequence) lists: shards (all, or ``shards``) in a
    shuffled order, taken ``buffer_shards`` at a time, their sequences length-bucketed into
    batches of about ``batch_tokens`` padded tokens, the window's batches shuffled."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(store.shards))) if shards is None else list(shards)
    rng.shuffle(order)
    plan = []
    for w in range(0, len(order), buffer_shards):
        seqs = [(s, i, n) for s in order[w:w + buffer_shards] for i, n in enumerate(store.shards[s]["lengths"])]
        seqs.sort(key=lambda x: (x[2], rng.random()))
        cur, width, batches = [], 0, []
        for s, i, n in seqs:
            if cur and max(width, n) * (len(cur) + 1) > batch_tokens:
                batches.append(cur)
                cur, width = [], 0
            cur.append((s, i))
            width = max(width, n)
        if cur:
            batches.append(cur)
        rng.shuffle(batches)
        plan += batches
    return plan


class ShardCache:
    """The last few shards loaded (a window of the plan touches ``buffer_shards``)."""

    def __init__(self, store: FeatureStore, keep: int):
        self.store, self.keep, self.cache = store, keep, {}

    def seq(self, shard: int, i: int) -> dict[str, torch.Tensor]:
        if shard not in self.cache:
            if len(self.cache) >= self.keep:
                self.cache.pop(next(iter(self.cache)))
            self.cache[shard] = self.store.load(shard)
        sh = self.cache[shard]
        a, b = int(sh["offsets"][i]), int(sh["offsets"][i + 1])
        return {k: v[a:b] for k, v in sh.items() if k != "offsets"}


def collate(seqs: list[dict[str, torch.Tensor]], feature: str = "aux", device="cpu") -> dict[str, torch.Tensor]:
    """Right-padded batch: feats [B, L, F], final [B, L, H], ids / lse / argmax / loss [B, L]."""
    B, L = len(seqs), max(s["ids"].numel() for s in seqs)
    out = {"feats": torch.zeros(B, L, seqs[0][feature].shape[1]), "final": torch.zeros(B, L, seqs[0]["final"].shape[1]),
           "ids": torch.zeros(B, L, dtype=torch.long), "lse": torch.zeros(B, L),
           "argmax": torch.zeros(B, L, dtype=torch.long), "loss": torch.zeros(B, L, dtype=torch.bool),
           "lens": torch.tensor([s["ids"].numel() for s in seqs])}
    for r, s in enumerate(seqs):
        n = s["ids"].numel()
        out["feats"][r, :n] = s[feature].float()
        out["final"][r, :n] = s["final"].float()
        out["ids"][r, :n] = s["ids"].long()
        out["lse"][r, :n] = s["lse"]
        out["argmax"][r, :n] = s["argmax"].long()
        out["loss"][r, :n] = s["loss"].bool()
    return {k: v.to(device) for k, v in out.items()}


def top_tokens(store: FeatureStore, n: int, vocab: int) -> torch.Tensor:
    """The ``n`` tokens the target predicts most often at learned positions (its argmax),
    ties by id; sorted ids."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for i in range(len(store.shards)):
        sh = store.load(i)
        counts += torch.bincount(sh["argmax"][sh["loss"].bool()].long(), minlength=vocab)
    if n >= vocab:
        return torch.arange(vocab)
    order = torch.argsort(counts * vocab + (vocab - 1 - torch.arange(vocab)), descending=True)
    return order[:n].sort().values


# ---- loss and acceptance ------------------------------------------------------------------
def feature_key(arch: str) -> str:
    """The stored feature a head of ``arch`` reads (``features.py``)."""
    return "aux" if arch == "eagle3" else "final"


def head_losses(head, batch: dict, passes: int, out_v: torch.Tensor, autocast: bool):
    """Per pass: (mean loss, greedy agreement with the target's argmax, positions). Entry j
    of pass s learns when the position j + 1 it predicts for is learned and j >= s - 1
    (earlier entries of pass s have no valid input)."""
    ctx = torch.autocast(out_v.device.type, dtype=torch.bfloat16, enabled=autocast)
    with ctx:
        outs = head(batch["feats"], batch["ids"], passes)
    b, j = batch["loss"][:, 1:].nonzero(as_tuple=True)  # entry j <-> position j + 1
    if b.numel() == 0:
        return [(None, 0.0, 0)] * passes
    with torch.no_grad():  # the target's log p on V at the learned positions, once for every pass
        fin = batch["final"][b, j + 1]
        p_v = (fin @ out_v.t() - batch["lse"][b, j + 1][:, None]).exp()  # [M, N]
        t_arg = batch["argmax"][b, j + 1]
    res = []
    for s, g in enumerate(outs, start=1):
        keep = j >= s - 1
        with ctx:
            logits = head.logits(g[b[keep], j[keep]])
        logq = torch.log_softmax(logits.float(), -1)
        loss = -(p_v[keep] * logq).sum(-1).mean()
        agree = (head.vocab_ids[logits.argmax(-1)] == t_arg[keep]).float().mean().item()
        res.append((loss, agree, int(keep.sum())))
    return res


@torch.no_grad()
def simulate_acceptance(head, batch: dict, k: int, prompt_lens: list[int]) -> list[dict]:
    """Greedy speculative decoding with ``k`` candidates over each row's answer (tokens
    from ``prompt_lens[r]`` on): per row, its steps, emitted, drafted, judged and accepted
    counts."""
    outs = head(batch["feats"], batch["ids"], k)
    draft = [head.vocab_ids[head.logits(g.float()).argmax(-1)].tolist() for g in outs]  # pass s: [B][L-1] target ids
    rows = []
    for r, n in enumerate(batch["lens"].tolist()):
        tot = {"steps": 0, "emitted": 0, "drafted": 0, "judged": 0, "accepted": 0, "first_drafted": 0,
               "first_accepted": 0}
        truth = batch["ids"][r].tolist()
        m = prompt_lens[r] + 1  # the prefill emitted x_P: x_0..x_P committed
        while m < n:
            kk = min(k, n - m - 1)  # the engine drafts at most remaining - 1
            a = 0
            while a < kk and draft[a][r][m - 2 + a] == truth[m + a]:  # pass a+1, entry m-2+a drafts x_{m+a}
                a += 1
            tot["steps"] += 1
            tot["emitted"] += a + 1
            if kk:
                tot["drafted"] += kk
                tot["judged"] += min(a + 1, kk)
                tot["accepted"] += a
                tot["first_drafted"] += 1
                tot["first_accepted"] += int(a >= 1)
            m += a + 1
        rows.append(tot)
    return rows


def summarize(tot: dict) -> dict:
    return {"a": tot["accepted"] / max(tot["judged"], 1), "acc_len": tot["emitted"] / max(tot["steps"], 1),
            "alpha": tot["first_accepted"] / max(tot["first_drafted"], 1), "steps": tot["steps"]}


def evaluate(head, store: FeatureStore, k: int, feature: str = "aux", batch_tokens: int = 4096) -> dict:
    dev = head.vocab_ids.device
    """Simulated acceptance per class (and overall, class-balanced) over a held-out store
    whose sequences are prompt + the target's greedy answer."""
    head.eval()
    per: dict[str, dict] = {}
    for sh_i, sh in enumerate(store.shards):
        seqs = list(store.sequences(sh_i))
        order = sorted(range(len(seqs)), key=lambda r: seqs[r][0]["ids"].numel())
        groups, cur = [], []
        for r in order:
            if cur and seqs[r][0]["ids"].numel() * (len(cur) + 1) > batch_tokens:
                groups.append(cur)
                cur = []
            cur.append(r)
        groups += [cur] if cur else []
        for grp in groups:
            sub = [seqs[r] for r in grp]
            lens = []
            for seq, _ in sub:
                loss = seq["loss"].bool()
                lens.append(int(loss.nonzero()[0]) + 1 if loss.any() else seq["ids"].numel())
            for (seq, cls), t in zip(sub, simulate_acceptance(head, collate([x for x, _ in sub], feature, dev), k, lens)):
                acc = per.setdefault(cls, {})
                for key, v in t.items():
                    acc[key] = acc.get(key, 0) + v
    head.train()
    res = {"per_class": {c: summarize(v) for c, v in sorted(per.items())}}
    vals = list(res["per_class"].values())
    for key in ("a", "acc_len", "alpha"):
        res[key] = sum(v[key] for v in vals) / max(len(vals), 1)
    pooled: dict[str, int] = {}
    for v in per.values():
        for key, n in v.items():
            pooled[key] = pooled.get(key, 0) + n
    res["pooled"] = summarize(pooled)  # every judged token counts once: steadier when a class has few sequences
    return res


# ---- the trainer ------------------------------------------------------------------------
@dataclass(slots=True)
class State:
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    curve: list = field(default_factory=list)
    best: float = -1.0


class ShardTrainer:
    def __init__(self, cfg: ShardTrainConfig, store: FeatureStore, held: FeatureStore | None, target_weights: dict,
                 tcfg, out: Path, target_name: str = "", feature_layers: list[int] | None = None,
                 vocab_ids: torch.Tensor | None = None, device="cpu"):
        from adaptspec.distill.head import DraftHead, HeadConfig, target_output_weight

        self.cfg, self.store, self.held, self.out = cfg, store, held, Path(out)
        self.device = torch.device(device)
        torch.manual_seed(cfg.seed)
        self.feature = feature_key(cfg.arch)
        warm = None
        if cfg.init_head:  # continue a saved head: its architecture and draft vocabulary
            from adaptspec.distill.head import load_head_state, read_head_config
            from adaptspec.models.registry import resolve

            folder = resolve(cfg.init_head, quiet=True)
            hc0, warm = read_head_config(folder), load_head_state(folder)
            if hc0.arch != cfg.arch or hc0.num_layers != cfg.layers:
                raise ValueError(f"init_head: {cfg.init_head} is a {hc0.num_layers}-layer {hc0.arch} head; "
                                 f"set arch={hc0.arch!r}, layers={hc0.num_layers}")
            vocab_ids = warm["vocab_ids"].to(torch.long)
        if vocab_ids is None:
            vocab_ids = top_tokens(store, cfg.vocab_top, tcfg.vocab_size)
        if cfg.arch == "eagle3":
            hc = HeadConfig.for_target(tcfg, cfg.layers, vocab_ids.numel(), arch="eagle3",
                                       feature_layers=list(store.manifest["meta"].get("feature_layers", [])
                                                           if feature_layers is None else feature_layers),
                                       norm_before_fc=cfg.norm_before_fc, norm_before_residual=cfg.norm_before_residual,
                                       fc_norm=cfg.fc_norm, norm_output=cfg.norm_output)
        else:
            hc = HeadConfig.for_target(tcfg, cfg.layers, vocab_ids.numel(), arch="adaptspec")
        hc.target = {"name": target_name, "vocab_size": tcfg.vocab_size, "hidden_size": tcfg.hidden_size,
                     "num_layers": tcfg.num_layers}
        embed = target_weights["model.embed_tokens.weight"].float()
        out_full = target_output_weight(target_weights, tcfg.tie_word_embeddings).float()
        self.head = DraftHead(hc, embed, out_full.index_select(0, vocab_ids), vocab_ids)
        if warm is not None:
            self.head.load_exported({k: v.float() if v.is_floating_point() else v for k, v in warm.items()})
        elif cfg.init == "target":
            self.head.init_from_target_layers(target_weights, tcfg.num_layers - cfg.layers)
        self.head.to(self.device)
        self.out_v = self.head.out_weight.detach()
        params = [p for p in self.head.parameters() if p.requires_grad]
        self.num_params = sum(p.numel() for p in params)
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.state = State()
        self.best_state = None
        self.shard_ids = [i for i, sh in enumerate(store.shards) if cfg.sources is None or sh.get("source") in cfg.sources]
        if not self.shard_ids:
            raise ValueError(f"sources: no training shard comes from {cfg.sources}")
        loss_tokens = max(1, sum(store.shards[i]["loss_tokens"] for i in self.shard_ids))
        self.total_tokens = int(cfg.epochs * loss_tokens)

    def _lr(self) -> float:
        c, s = self.cfg, self.state
        warm = min(1.0, (s.step + 1) / max(1, c.warmup_steps))
        if c.time_budget_s:
            frac = s.elapsed_s / c.time_budget_s
        elif c.steps:
            frac = s.step / c.steps
        else:
            frac = s.tokens_seen / max(1, self.total_tokens)
        return c.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    def _done(self) -> bool:
        c, s = self.cfg, self.state
        if c.time_budget_s is not None and s.elapsed_s >= c.time_budget_s:
            return True
        if c.steps is not None:  # a step budget replaces the epochs
            return s.step >= c.steps
        return s.tokens_seen >= self.total_tokens

    def eval_point(self, train_loss: float | None) -> dict:
        ev = evaluate(self.head, self.held, self.cfg.eval_k, self.feature) if self.held is not None else {}
        s = self.state
        s.curve.append({"step": s.step, "tokens_seen": s.tokens_seen, "elapsed_s": round(s.elapsed_s, 1),
                        "train_loss": train_loss, "held_out": ev})
        # the best head by pooled acceptance: the class mean swings with a class of a few sequences
        score = ev["pooled"]["a"] if ev else -s.step
        if score > s.best:
            s.best = score
            self.best_state = {k: v.detach().clone() for k, v in self.head.state_dict().items()}
        return ev

    def train(self, resume: bool = True, progress: bool = True) -> State:
        from tqdm import tqdm

        c = self.cfg
        ck = self.out / "ckpt.pt"
        if resume and ck.is_file():
            self._load(ck)
        self.out.mkdir(parents=True, exist_ok=True)
        if not self.state.curve:
            self.eval_point(None)
        cache = ShardCache(self.store, c.buffer_shards + 1)
        by_steps = c.steps is not None
        bar = tqdm(total=c.steps if by_steps else self.total_tokens,
                   initial=self.state.step if by_steps else self.state.tokens_seen,
                   desc="train", unit="step" if by_steps else "tok", disable=not progress, smoothing=0.05)
        losses: list[float] = []
        last_ck = time.perf_counter()
        while not self._done():
            s = self.state
            plan = epoch_plan(self.store, s.epoch, c.batch_tokens, c.buffer_shards, c.seed, self.shard_ids)
            while s.batch_in_epoch < len(plan) and not self._done():
                t0 = time.perf_counter()
                batch = collate([cache.seq(a, b) for a, b in plan[s.batch_in_epoch]], self.feature, self.device)
                res = head_losses(self.head, batch, c.passes, self.out_v, c.autocast)
                terms = [(0.8 ** i) * r[0] for i, r in enumerate(res) if r[0] is not None]
                n_pos = res[0][2]
                s.batch_in_epoch += 1
                if terms:
                    loss = sum(terms) / sum(0.8 ** i for i, r in enumerate(res) if r[0] is not None)
                    for g in self.opt.param_groups:
                        g["lr"] = self._lr()
                    self.opt.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
                    self.opt.step()
                    losses.append(float(loss.detach()))
                s.step += 1
                s.tokens_seen += n_pos
                s.elapsed_s += time.perf_counter() - t0
                bar.update(1 if by_steps else n_pos)
                bar.set_postfix(loss=f"{losses[-1]:.3f}" if losses else "-", a=f"{s.curve[-1]['held_out'].get('a', 0):.3f}"
                                if s.curve and s.curve[-1]["held_out"] else "-", epoch=s.epoch)
                if c.eval_every_steps and s.step % c.eval_every_steps == 0:
                    self.eval_point(sum(losses[-50:]) / max(1, len(losses[-50:])) if losses else None)
                if time.perf_counter() - last_ck > c.checkpoint_every_s:
                    self._save(ck)
                    last_ck = time.perf_counter()
            if s.batch_in_epoch >= len(plan):
                s.epoch, s.batch_in_epoch = s.epoch + 1, 0
        bar.close()
        self.eval_point(sum(losses[-50:]) / max(1, len(losses[-50:])) if losses else None)
        self._save(ck)
        return self.state

    def use_best(self) -> None:
        if self.best_state is not None:
            self.head.load_state_dict(self.best_state)

    def _save(self, path: Path) -> None:
        tmp = Path(str(path) + ".tmp")
        torch.save({"head": self.head.state_dict(), "opt": self.opt.state_dict(), "state": asdict(self.state),
                    "best": self.best_state, "config": asdict(self.cfg),
                    "vocab_ids": self.head.vocab_ids.clone()}, tmp)
        tmp.replace(path)

    def _load(self, path: Path) -> None:
        ck = torch.load(path, weights_only=False, map_location=self.device)
        for key in ("arch", "layers", "passes", "vocab_top", "norm_before_fc", "norm_before_residual", "fc_norm", "norm_output"):
            if ck["config"].get(key, "eagle3" if key == "arch" else None) != getattr(self.cfg, key):
                raise ValueError(f"resume: {path} was trained with {key}={ck['config'][key]}, not "
                                 f"{getattr(self.cfg, key)}; use the same settings or another run folder")
        if not torch.equal(ck["vocab_ids"].cpu(), self.head.vocab_ids.cpu()):
            raise ValueError(f"resume: {path} has another draft vocabulary (the data changed); use a new run folder")
        self.head.load_state_dict(ck["head"])
        self.opt.load_state_dict(ck["opt"])
        self.state = State(**ck["state"])
        self.best_state = ck.get("best")
