"""The engine: continuous batching with exact speculative decoding. Ray-free.

One ``step()``: the scheduler picks rows under the step's token budget (running requests'
last token plus their ``k`` candidates first, prompt chunks after); the drafters propose;
ONE flattened target forward runs every row; the verifier keeps each request's accepted
prefix plus one target token; the commit appends tokens, rolls KV lengths back, feeds the
draft head and registers full blocks in the prefix cache.
"""
from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence as Seq

import numpy as np
import torch

from adaptspec.engine import verifier
from adaptspec.engine.kv_cache import BlockPool, KVCacheManager
from adaptspec.engine.params import MAX_K, SamplingParams, SpecConfig
from adaptspec.engine.proposers import Draft, DraftModelProposer, HeadProposer, NgramProposer, Proposer
from adaptspec.engine.scheduler import ScheduledRow, Scheduler, SchedulerOutput
from adaptspec.engine.sequence import RequestOutput, Sequence, Status
from adaptspec.engine.suffix import SuffixProposer
from adaptspec.engine.stats import ForwardTimer, Lap, RequestStepStats, SpecStats, StepStats
from adaptspec.models.batch import FlatBatch
from adaptspec.models.cuda_graph import DEFAULT_MAX_TOKENS, GraphRunner
from adaptspec.models.loader import LoadedHead, LoadedModel, load_draft, load_model

log = logging.getLogger("adaptspec.engine")


@dataclass(slots=True)
class EngineConfig:
    """Every switch of the engine (the service's ``engine:`` section maps onto it)."""

    max_num_seqs: int = 16  # requests running at once
    max_model_len: int = 2048  # prompt + output (+ candidates) per request
    # tokens one step may run through the target: decode and verification rows first (their
    # k shrinks when it runs short), then prompt chunks; bounds how long a prompt can hold
    # running requests. None: max(256, 4 * max_num_seqs)
    max_num_batched_tokens: int | None = None
    block_size: int = 16  # positions per KV block (a multiple of 8 for the CPU kernels)
    enable_prefix_caching: bool = True
    # KV pool size: bytes (> 1), a fraction of the device memory free after the weights and
    # the CUDA graphs (<= 1; CUDA), or None: room for max_num_seqs full-length requests
    # (every model's KV counted)
    kv_cache_memory: float | None = None
    # decode / verification steps (no prompt chunk) of up to cuda_graph_max_tokens rows replay
    # a CUDA graph of the target's forward, padded to a token-count bucket; larger steps and
    # steps with prompt chunks run eagerly. A draft model's or draft head's passes likewise
    # (passes of decode-sized rows). None: on for CUDA when the attention backend can be
    # captured (Triton; a draft whose backend cannot stays eager). True on the CPU runs the
    # same padded static-buffer path without capturing (what the CPU tests check; slower than
    # the default, which is off there)
    cuda_graphs: bool | None = None
    cuda_graph_max_tokens: int = DEFAULT_MAX_TOKENS  # capped at max_num_batched_tokens
    ngram_max_n: int = 3
    ngram_min_n: int = 1
    suffix_drafter: bool = True  # offer the suffix drafter ("suffix") besides n-gram lookup
    verifier: str = "auto"  # auto | torch | triton: the rejection-sampling backend

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2 * (MAX_K + 1):
            raise ValueError(f"max_model_len must be >= {2 * (MAX_K + 1)}, got {self.max_model_len}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(256, 4 * self.max_num_seqs)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens must be >= max_num_seqs ({self.max_num_seqs}): every "
                             f"running request needs a token a step, got {self.max_num_batched_tokens}")
        if self.block_size < 1 or self.block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {self.block_size}")
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be > 0 (bytes, or a fraction <= 1), got {self.kv_cache_memory}")
        if self.cuda_graph_max_tokens < 1:
            raise ValueError(f"cuda_graph_max_tokens must be >= 1, got {self.cuda_graph_max_tokens}")
        if self.verifier not in ("auto", "torch", "triton"):
            raise ValueError(f"verifier must be auto, torch or triton, got {self.verifier!r}")


class Engine:
    def __init__(self, target: LoadedModel, draft: LoadedModel | LoadedHead | None = None,
                 config: EngineConfig | None = None):
        self.config = cfg = config or EngineConfig()
        self.target, self.draft = target, draft
        self.tokenizer = target.tokenizer
        self.device = target.model.device
        cap = min(cfg.max_model_len, target.model.cfg.max_position)
        if draft is not None and draft.model.cfg.max_position < cap:  # its rotary tables end there
            log.warning("max_model_len %d -> %d: the draft %s has positions up to %d only", cap,
                        draft.model.cfg.max_position, draft.name, draft.model.cfg.max_position)
            cap = draft.model.cfg.max_position
        cfg.max_model_len = cap
        self.verifier_backend = verifier.select_backend(self.device, cfg.verifier)
        self.proposers: dict[str, Proposer] = {"ngram": NgramProposer(cfg.ngram_max_n, cfg.ngram_min_n)}
        if cfg.suffix_drafter:  # prompt + output + the class's recent outputs (engine.suffix)
            self.proposers["suffix"] = SuffixProposer()
        kv_models = [target.model]
        self.feature_layers: tuple[int, ...] = ()  # target states the head drafts from
        self._taps: tuple[int, ...] = ()  # what the target forward returns for them
        if isinstance(draft, LoadedHead):  # a feature-level head drafts from the target's features
            kv_models.append(draft.model)
            self.proposers["draft"] = HeadProposer(draft.model)
            fl = tuple(getattr(draft.model.cfg, "feature_layers", None) or ())
            if fl:
                self.feature_layers = fl
                self._taps = tuple(sorted(set(fl) | {target.model.cfg.num_layers}))
        elif draft is not None:
            check_same_vocab(target, draft)
            kv_models.append(draft.model)
            self.proposers["draft"] = DraftModelProposer(draft.model)
        self.graphs, self.draft_graphs = self._setup_kv_and_graphs(kv_models)
        if self.draft_graphs is not None:
            self.proposers["draft"].graphs = self.draft_graphs
        self.pool = BlockPool(self.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, reuse_margin=1 if isinstance(draft, LoadedHead) else 0)
        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, self._on_admit)
        self.requests: dict[str, Sequence] = {}
        self.eos_ids = _eos_ids(target)
        self.step_count = 0
        self.drafter_errors = 0  # proposer calls that raised (their requests ran with k = 0)
        self.totals = SpecStats()
        self.last_step: StepStats | None = None
        self.step_listeners: list[Callable[[StepStats], None]] = []
        # TPOT-paced prefill (``adaptspec.control.pacing.PrefillPacer``): caps each step's prompt
        # chunks for the request classes with a TPOT target; None: chunks fill the step's budget
        self.pacer = None
        # CUDA: the forward timed by events, read once complete (ForwardTimer); steps whose
        # events are still running wait here, published in order
        self._timer = ForwardTimer() if self.device.type == "cuda" else None
        self._unpublished: collections.deque = collections.deque()
        self._ids = itertools.count()

    def _setup_kv_and_graphs(self, kv_models) -> tuple[GraphRunner | None, GraphRunner | None]:
        """Size and allocate the KV pool, then capture the CUDA graphs: the target's and the
        draft model's or head's. With the pool a fraction of free memory, the graphs are first
        captured against a two-block pool to measure what they hold, so the fraction applies
        to the memory left after them. With graphs, every model's pool has one block more
        than the engine hands out: the pad block that padding rows write to."""
        cfg, bs = self.config, self.config.block_size
        use = self._graphs_wanted(self.target.model.attn, "target")
        draft_use = use and self.draft is not None and self._graphs_wanted(self._draft_decoder().attn, "draft")
        capture = use and self.device.type == "cuda"
        graph_bytes = 0
        mem = cfg.kv_cache_memory
        if capture and mem is not None and mem <= 1:
            for m in kv_models:
                m.allocate_kv(2, bs)
            probes = self._graph_runners(1, True, draft_use)
            graph_bytes = sum(r.graph_bytes for r in probes if r is not None)
            for r in probes:
                if r is not None:
                    r.release()
            del probes
            for m in kv_models:
                m.allocate_kv(0, bs)
            torch.cuda.empty_cache()
        self.num_blocks = self._num_blocks(kv_models, graph_bytes)
        for m in kv_models:
            m.allocate_kv(self.num_blocks + (1 if use else 0), bs)
        if not use:
            return None, None
        return self._graph_runners(self.num_blocks, capture, draft_use)

    def _draft_decoder(self):
        """The draft's LlamaModel: the draft model, or a head's decoder."""
        return self.draft.model.decoder if isinstance(self.draft, LoadedHead) else self.draft.model

    def _graphs_wanted(self, attn, which: str) -> bool:
        want = self.config.cuda_graphs
        if want is None:
            ok = self.device.type == "cuda" and getattr(attn, "graph_safe", False)
            if not ok and which == "draft" and self.device.type == "cuda":
                log.info("cuda_graphs: the draft's %r attention cannot be captured; it drafts eagerly", attn.name)
            return ok
        if want and self.device.type == "cuda" and not getattr(attn, "graph_safe", False):
            raise ValueError(f"cuda_graphs: the {which}'s {attn.name!r} attention backend cannot be captured "
                             "(the Triton backend can: install triton)")
        return want

    def _graph_runners(self, pad_block: int, capture: bool, draft: bool):
        """(the target's runner, the draft's or None): the same buckets, limits and pad block."""
        cfg = self.config
        kw = dict(max_tokens=min(cfg.cuda_graph_max_tokens, cfg.max_num_batched_tokens), max_seqs=cfg.max_num_seqs,
                  max_blocks_per_seq=-(-cfg.max_model_len // cfg.block_size), pad_block=pad_block, capture=capture)
        target = GraphRunner(self.target.model, feature_layers=self._taps, **kw)
        if not draft:
            return target, None
        if isinstance(self.draft, LoadedHead):  # the head's layers; its input layer stays eager
            head = self.draft.model
            return target, GraphRunner(head.decoder, step_fn=lambda batch, x: head.step(x, batch),
                                       input_width=head.cfg.hidden_size, input_dtype=head.compute_dtype,
                                       name="draft head", **kw)
        return target, GraphRunner(self.draft.model, name="draft model", **kw)

    def _num_blocks(self, models, graph_bytes: int = 0) -> int:
        cfg, bs = self.config, self.config.block_size
        per_block = sum(m.kv_bytes_per_block(bs) for m in models)
        mem = cfg.kv_cache_memory
        if mem is None:
            return cfg.max_num_seqs * -(-cfg.max_model_len // bs)
        if mem <= 1:
            if self.device.type != "cuda":
                raise ValueError("kv_cache_memory: a fraction of free memory needs a CUDA device; give bytes")
            free, _ = torch.cuda.mem_get_info(self.device)
            mem = max(0, free - graph_bytes) * mem  # what the graphs will hold is not free
        n = int(mem // per_block)
        need = -(-cfg.max_model_len // bs)
        if n < need:
            raise ValueError(f"kv_cache_memory: {int(mem)} bytes hold {n} blocks of {bs} positions; one request "
                             f"of max_model_len={cfg.max_model_len} needs {need} ({per_block} bytes a block)")
        return n

    @classmethod
    def from_pretrained(cls, target: str = "smollm2-135m", draft: str | None = None, dtype="float32",
                        device="cpu", **config) -> "Engine":
        """Load models by alias, folder, .gguf or hub id. ``config``: EngineConfig fields."""
        cfg = EngineConfig(**config)
        t = load_model(target, dtype=dtype, device=device, quiet=True)
        d = load_draft(draft, t, dtype=dtype, device=device, quiet=True) if draft else None
        return cls(t, d, cfg)

    # ---- public surface for the service ----------------------------------------------
    def add_proposer(self, name: str, proposer: Proposer) -> None:
        """Make a drafter available under ``name`` (arms may then use it)."""
        self.proposers[name] = proposer

    def wrap_proposers(self, wrap: Callable[[str, Proposer], Proposer]) -> None:
        """Replace every drafter by ``wrap(name, drafter)`` (e.g. a fault guard)."""
        for name, prop in list(self.proposers.items()):
            self.proposers[name] = wrap(name, prop)

    @property
    def free_seqs(self) -> int:
        """Requests that can start running now."""
        return self.scheduler.free_seqs

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks held by requests."""
        return self.pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.pool.hits / self.pool.queries if self.pool.queries else 0.0

    # ---- requests --------------------------------------------------------------------
    def encode(self, prompt: str | Seq[int], raw: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt: empty prompt")
            if raw or not getattr(self.tokenizer, "chat_template", None):
                return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                     add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt: empty prompt_token_ids")
        vocab = self.target.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids: ids must be in [0, {vocab})")
        return ids

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                    spec: SpecConfig | None = None, *, request_id: str | None = None,
                    request_class: str = "default", raw: bool = False, arrival_s: float | None = None) -> str:
        # TTFT and e2e count tokenization (the chat template) too; ``arrival_s`` (perf_counter):
        # when a caller that hands requests over between steps took this one, so they count the
        # step it waited for as well
        arrival = time.perf_counter() if arrival_s is None else arrival_s
        params, spec = params or SamplingParams(), spec or SpecConfig()
        self._check_spec(spec)
        ids = self.encode(prompt, raw)
        if not ids:
            raise ValueError("prompt: the prompt tokenizes to no tokens")
        limit = self.config.max_model_len - MAX_K - 1
        if len(ids) >= limit:  # too long whatever max_new_tokens is: the prompt is at fault
            raise ValueError(f"prompt: {len(ids)} tokens, past the context limit (at most {limit - 1} fit with one "
                             f"new token; max_model_len={self.config.max_model_len})")
        if len(ids) + params.max_new_tokens > limit:
            raise ValueError(f"max_new_tokens={params.max_new_tokens} is past the context limit: the prompt has "
                             f"{len(ids)} tokens and at most {limit} fit (max_model_len={self.config.max_model_len})")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        gen = torch.Generator()
        gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,))))
        seq = Sequence(rid, ids, len(ids), params, spec, request_class, gen, arrival_s=arrival)
        self.requests[rid] = seq
        self.scheduler.add(seq)
        return rid

    def set_spec(self, request_id: str, spec: SpecConfig) -> None:
        """Change a request's arm between steps (the controller does)."""
        self._check_spec(spec)
        self.requests[request_id].spec = spec

    def abort(self, request_id: str) -> bool:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _check_spec(self, spec: SpecConfig) -> None:
        if spec.drafter not in ("none", *self.proposers):
            raise ValueError(f"drafter {spec.drafter!r} is not available: this engine has no draft model "
                             "(load one with draft=...)")

    # ---- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self.pacer is None:
            plan = self.scheduler.schedule(self._k_for)
        else:
            plan = self.scheduler.schedule(self._k_for, self._prompt_cap, self._prompt_deadline)
        drafts = self._propose(plan.rows)
        t1 = time.perf_counter()
        logits, hidden = self._forward(plan.rows, drafts)
        emitted = self._verify(plan.rows, drafts, logits)  # the step's one host transfer
        t2 = time.perf_counter()
        outputs: dict[str, RequestOutput] = {}
        req_stats = self._commit(plan.rows, drafts, emitted, hidden, outputs)
        t3 = time.perf_counter()
        self._record(plan, drafts, req_stats, t0, t1, t2, t3)
        return list(outputs.values())

    def _prompt_deadline(self, s: Sequence) -> float:
        return self.pacer.deadline(s.request_class, s.arrival_s)

    def _prompt_cap(self, rows: list[ScheduledRow], budget: int, pending: list[Sequence]) -> int:
        """TPOT-paced prefill: the prompt tokens this step may carry (``PrefillPacer``)."""
        now = time.perf_counter()
        sched = self.scheduler
        waiting = [(s.request_class, len(s.token_ids) - s.num_computed, now - s.arrival_s) for s in pending]
        # every slot taken while requests wait: holding prompt work back only keeps them waiting
        blocked = bool(sched.waiting) and len(sched.running) >= sched.max_num_seqs
        return self.pacer.prompt_budget({r.seq.request_class for r in rows}, sum(r.num_new + r.k for r in rows),
                                        waiting, budget, blocked=blocked)

    def generate(self, prompts: Seq[str | Seq[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 spec: SpecConfig | list[SpecConfig] | None = None, *, raw: bool = False,
                 request_class: str | list[str] = "default") -> list[RequestOutput]:
        """Run prompts to completion (queued past ``max_num_seqs``); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of prompts (strings or token-id lists)")
        n = len(prompts)
        params_l, spec_l, cls_l = (_per_prompt(x, n, name) for x, name in
                                   ((params or SamplingParams(), "params"), (spec or SpecConfig(), "spec"),
                                    (request_class, "request_class")))
        rids = [self.add_request(p, sp, sc, request_class=c, raw=raw)
                for p, sp, sc, c in zip(prompts, params_l, spec_l, cls_l)]
        done: dict[str, RequestOutput] = {}
        while len(done) < n:
            for out in self.step():
                if out.finished and out.request_id in rids:
                    done[out.request_id] = out
        return [done[r] for r in rids]

    # ---- phases ------------------------------------------------------------------------
    def _k_for(self, s: Sequence) -> int:
        """The candidates ``s`` may verify this step: its arm's k, within its token and
        context limits."""
        if not s.spec.speculates:
            return 0
        return max(0, min(s.spec.k, s.remaining - 1, self.config.max_model_len - len(s.token_ids) - 1))

    def _on_admit(self, s: Sequence) -> None:
        for prop in self.proposers.values():
            prop.on_admit(s)

    def _propose(self, rows: list[ScheduledRow]) -> list[Draft]:
        drafts = [_NO_DRAFT] * len(rows)
        by_drafter: dict[str, list[int]] = {}
        for i, r in enumerate(rows):
            if r.k > 0:
                by_drafter.setdefault(r.seq.spec.drafter, []).append(i)
        for name, idx in by_drafter.items():
            prop, seqs = self.proposers[name], [rows[i].seq for i in idx]
            try:
                proposed = prop.propose(seqs, [rows[i].k for i in idx])
            except Exception:  # a failing drafter means k = 0 for its requests, never a lost request
                log.exception("drafter %r failed; its %d requests decode plainly this step", name, len(idx))
                self.drafter_errors += 1
                for s in seqs:  # nothing drafted was accepted: roll the drafter's state back
                    prop.on_verified(s, len(s.token_ids), 0, None)
                proposed = [_NO_DRAFT] * len(idx)
            for i, d in zip(idx, proposed):
                drafts[i] = _cut(d, rows[i].k, rows[i].seq.spec.min_confidence)
        return drafts

    def _forward(self, rows: list[ScheduledRow], drafts: list[Draft]):
        """The target's forward over the step: ``(logits [num_logits, vocab], hidden)``. A step
        of decode / verification rows only that fits the graphs replays one (graphs on); any
        other step runs eagerly on its exact (unpadded) batch."""
        if self._timer is not None:  # CUDA: the forward's time from events (stopped in _verify)
            self._timer.start()
        tokens, ctx, tables, logit_rows = self._layout(rows, drafts)
        g = self.graphs
        if g is not None and all(r.decode for r in rows) and \
                g.fits(sum(map(len, tokens)), len(tokens), max((len(t) for t in tables), default=0)):
            return g.forward(tokens, ctx, tables, logit_rows)
        batch = FlatBatch.build(tokens, ctx, tables, logit_rows, self.config.block_size, self.device)
        return self.target.model.forward(batch, feature_layers=self._taps)

    def _layout(self, rows: list[ScheduledRow], drafts: list[Draft]):
        """The step's flattened batch as host lists (``FlatBatch.build``'s arguments): each
        row's uncomputed tokens then its candidates; logits for rows that reach their
        sequence's end (the last token and each candidate)."""
        tokens, logit_rows, at = [], [], 0
        for r, d in zip(rows, drafts):
            s = r.seq
            t = s.token_ids[s.num_computed:s.num_computed + r.num_new]
            if d.token_ids:
                t = t + d.token_ids
            tokens.append(t)
            if r.samples:
                last = at + r.num_new - 1
                logit_rows.extend(range(last, last + len(d.token_ids) + 1))
            at += len(t)
        return tokens, [r.seq.num_computed for r in rows], [r.seq.block_table for r in rows], logit_rows

    def _verify(self, rows: list[ScheduledRow], drafts: list[Draft], logits) -> list[list[int]]:
        """Each sampling row's accepted candidates plus its recovered or bonus token."""
        sampling = [i for i, r in enumerate(rows) if r.samples]
        emitted: list[list[int]] = [[] for _ in rows]
        if not sampling:  # no transfer this step (prompt chunks only)
            if self._timer is not None:
                self._timer.stop()
            return emitted
        n = [len(drafts[i].token_ids) for i in sampling]
        seqs = [rows[i].seq for i in sampling]
        greedy = [j for j, s in enumerate(seqs) if s.params.greedy]
        if len(greedy) == len(sampling) and self.device.type == "cpu":  # argmax on the host, no tensor ops
            for j, toks in enumerate(verifier.verify_greedy_host(_argmax_rows(logits),
                                                                 [drafts[i].token_ids for i in sampling])):
                emitted[sampling[j]] = toks
            return emitted
        stoch = [j for j, s in enumerate(seqs) if not s.params.greedy]
        row_start = np.concatenate([[0], np.cumsum(np.asarray(n) + 1)])
        parts = []  # [members, max_k + 2]: accepted count, then tokens (-1 padded)
        for members, is_greedy in ((greedy, True), (stoch, False)):
            if not members:
                continue
            sel = (logits if len(members) == len(sampling) else logits.index_select(0, self._put(torch.from_numpy(
                np.concatenate([np.arange(row_start[j], row_start[j + 1]) for j in members])))))
            d_ids = self._put([t for j in members for t in drafts[sampling[j]].token_ids], torch.long)
            num_draft = self._put([n[j] for j in members], torch.long)
            max_k = max(n[j] for j in members)
            if is_greedy:
                res = verifier.verify_greedy_dispatch(sel, d_ids, num_draft, max_num_draft_tokens=max_k,
                                                      backend=self.verifier_backend)
            else:
                res = self._verify_stochastic([seqs[j] for j in members], [drafts[sampling[j]] for j in members],
                                              sel, d_ids, num_draft, max_k)
            out = torch.full((len(members), 1 + MAX_K + 1), -1, dtype=torch.long, device=self.device)
            out[:, 0] = res.num_accepted
            out[:, 1:1 + res.output_token_ids.shape[1]] = res.output_token_ids
            parts.append((members, out))
        if self._timer is not None:
            self._timer.stop()  # before the transfer, which then also completes the timing events
        host = torch.cat([p for _, p in parts]).tolist()  # one device-to-host transfer
        for j, (a, *o) in zip([j for members, _ in parts for j in members], host):
            emitted[sampling[j]] = o[:a + 1]
        return emitted

    def _put(self, x, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Host data (a list or CPU tensor) on the engine's device. On CUDA the copy is
        queued without waiting: ``torch.tensor(..., device="cuda")`` would wait for the
        forward still running, a second sync in the step."""
        t = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=dtype)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def _verify_stochastic(self, seqs, drafts, logits, draft_ids, num_draft, max_k):
        """Temperature / top-k / top-p per request, then exact verification. Each request
        draws exactly k + 1 uniforms from its own generator, whatever else is in the batch."""
        dev, vocab = self.device, logits.shape[-1]
        q = None
        if any(d.probs is not None for d in drafts):  # n-gram rows inside a model-draft batch: one-hot q
            q = torch.cat([d.probs.to(dev) if d.probs is not None else
                           torch.zeros(len(d.token_ids), vocab, device=dev).scatter_(
                               1, self._put(d.token_ids, torch.long)[:, None], 1.0) for d in drafts])
        u = [torch.rand(len(d.token_ids) + 1, generator=s.generator) for s, d in zip(seqs, drafts)]
        u_accept = self._put(torch.cat([x[:-1] for x in u]))
        u_sample = self._put(torch.stack([x[-1] for x in u]))
        temperature = self._put([s.params.temperature for s in seqs])
        top_k = self._put([s.params.top_k for s in seqs])
        top_p = self._put([s.params.top_p for s in seqs])
        max_top_k = max(s.params.top_k for s in seqs)  # decided on the host: no device sync
        any_top_p = any(s.params.top_p < 1.0 for s in seqs)
        return verifier.verify_stochastic_from_logits_dispatch(
            logits, temperature, top_k if max_top_k > 0 else None, top_p if any_top_p else None,
            draft_ids, q, num_draft, u_accept, u_sample, max_num_draft_tokens=max_k,
            max_top_k=max_top_k, backend=self.verifier_backend)

    def _commit(self, rows, drafts, emitted, hidden, outputs) -> list[RequestStepStats]:
        stats = []
        observed: list[tuple[Sequence, int, int]] = []  # (seq, first feature row, committed positions)
        at = 0
        now = time.perf_counter()
        for r, d, toks in zip(rows, drafts, emitted):
            s, start = r.seq, at
            at += r.num_new + len(d.token_ids)
            if not r.samples:  # a prompt chunk: its positions are committed, nothing sampled
                s.num_computed += r.num_new
                observed.append((s, start, r.num_new))
                continue
            before, accepted = len(s.token_ids), len(toks) - 1
            s.num_computed = before + accepted
            if s.first_token_s is None:
                s.first_token_s = now
            prop = self.proposers.get(s.spec.drafter)
            if prop is not None and r.k > 0:
                prop.on_verified(s, before, accepted, None)
            n_emitted = self._append(s, toks, outputs)
            observed.append((s, start, r.num_new + accepted))
            if r.decode:  # a decode / verification row (a prompt's last chunk is not a step)
                # accepted = drafted tokens kept: none past an EOS or stop string that ended the request
                rs = RequestStepStats(s.request_id, s.request_class, s.spec.drafter if r.k else "none", r.k,
                                      len(d.token_ids), min(accepted, n_emitted), n_emitted,
                                      list(d.confidence or ()), before - s.num_prompt_tokens,
                                      s.spec.min_confidence if r.k else 0.0)
                s.stats.observe_step(rs)
                self.totals.observe_step(rs)
                stats.append(rs)
        live = [(s, st, c) for s, st, c in observed if not s.finished]
        for prop in self.proposers.values():
            if prop.wants_features and live:
                feats = hidden if not self.feature_layers else self._head_features(hidden)
                prop.observe([s for s, _, _ in live], [st for _, st, _ in live], [c for _, _, c in live], feats)
        for s, _, _ in live:
            self.kv.commit(s)
        for s, _, _ in observed:
            if s.finished:
                self.scheduler.finish(s)
                self.requests.pop(s.request_id, None)
        return stats

    def _head_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's feature layers, in its order, out of the target's tapped states."""
        H = self.target.model.cfg.hidden_size
        cols = [self._taps.index(layer) for layer in self.feature_layers]
        return torch.cat([hidden[:, c * H:(c + 1) * H] for c in cols], 1)

    def _append(self, s: Sequence, toks: list[int], outputs: dict) -> int:
        """Append emitted tokens, stopping at EOS, stop strings or max_new_tokens."""
        new = []
        for tok in toks:
            s.token_ids.append(tok)
            new.append(tok)
            if tok in self.eos_ids and not s.params.ignore_eos:
                self._finish(s, "stop")
            elif s.params.stop and self._hit_stop(s):  # before the length: the last token may complete one
                self._finish(s, "stop")
            elif s.remaining <= 0:
                self._finish(s, "length")
            if s.finished:
                break
        outputs[s.request_id] = self._output(s, new)
        return len(new)

    def _hit_stop(self, s: Sequence) -> bool:
        text = self.tokenizer.decode(s.output_ids[-64:], skip_special_tokens=True)
        return any(st in text for st in s.params.stop)

    def _finish(self, s: Sequence, reason: str) -> None:
        if s.status is Status.FINISHED:
            return
        s.status, s.finish_reason, s.finish_s = Status.FINISHED, reason, time.perf_counter()
        s.stats.wall_s = s.finish_s - s.arrival_s
        s.stats.cached_prompt_tokens = s.num_cached_tokens
        for prop in self.proposers.values():
            prop.release(s)
        if reason == "abort":
            self.scheduler.finish(s)

    def _output(self, s: Sequence, new: list[int]) -> RequestOutput:
        text = ""
        if s.finished:
            text = self.tokenizer.decode(s.output_ids, skip_special_tokens=True)
            if s.finish_reason == "stop" and s.params.stop:
                cut = min((text.find(st) for st in s.params.stop if st in text), default=-1)
                text = text[:cut] if cut >= 0 else text
        return RequestOutput(s.request_id, list(new), s.output_ids, s.finished, s.finish_reason, text,
                             s.stats if s.finished else None, s.token_ids[:s.num_prompt_tokens],
                             (s.first_token_s - s.arrival_s) if s.first_token_s else None,
                             (s.finish_s - s.arrival_s) if s.finish_s else None)

    def _record(self, plan: SchedulerOutput, drafts, req_stats, t0, t1, t2, t3) -> None:
        rows = plan.rows
        prefill_tokens = sum(r.num_new for r in rows if not r.decode)
        verify_tokens = sum(1 + len(d.token_ids) for r, d in zip(rows, drafts) if r.decode)
        st = StepStats(self.step_count, sum(1 for r in rows if r.decode),
                       sum(1 for r in rows if not r.decode), prefill_tokens, verify_tokens,
                       sum(r.seq.num_computed for r in rows), len(self.scheduler.waiting),
                       0.0, t1 - t0, t2 - t1, t3 - t2, t3 - t0, req_stats, t3,
                       len(self.scheduler.waiting) + len(self.scheduler.running), plan.prompts_held)
        self.step_count += 1
        if self.pacer is not None:
            per_class: dict[str, tuple[int, int]] = {}
            for r in req_stats:
                tok, n = per_class.get(r.request_class, (0, 0))
                per_class[r.request_class] = (tok + r.emitted, n + 1)
            self.pacer.observe(t3 - t0, verify_tokens, prefill_tokens, per_class)
        if self._timer is None:  # the CPU: host clocks, published now
            self._publish(st, None)
            return
        self._unpublished.append((st, self._timer.lap()))
        self.flush_stats(wait=not self.scheduler.has_unfinished())  # idle: nothing left to overlap

    def flush_stats(self, wait: bool = True) -> None:
        """Publish the steps whose timing events have run (CUDA), in order; every older step
        is waited for, and with ``wait`` the latest too."""
        q = self._unpublished
        while q:
            st, lap = q[0]
            if len(q) == 1 and not wait and not lap.ready():
                return
            q.popleft()
            self._publish(st, lap)

    def _publish(self, st: StepStats, lap: Lap | None) -> None:
        # verify_s holds the host-clock forward until here; on CUDA the events' time replaces it
        forward_s = lap.seconds() if lap is not None else st.verify_s
        # the prompt chunks ride in the same forward: their share of it, by tokens, is reported
        # as prefill time (for benchmarks that leave the prompt out; the controller's adapter,
        # StepOutcome.from_step_stats, puts the forward back together)
        st.prefill_s = forward_s * st.prefill_tokens / max(1, st.prefill_tokens + st.verify_tokens)
        st.verify_s = forward_s - st.prefill_s
        self.last_step = st
        for fn in self.step_listeners:
            fn(st)


_NO_DRAFT = Draft([], None, [])


def _cut(d: Draft, k: int, min_confidence: float) -> Draft:
    """At most ``k`` candidates, stopping before the first below ``min_confidence``."""
    n = min(len(d.token_ids), k)
    if min_confidence > 0 and d.confidence:
        n = next((j for j, c in enumerate(d.confidence[:n]) if c < min_confidence), n)
    if n == len(d.token_ids):
        return d
    return Draft(d.token_ids[:n], None if d.probs is None else d.probs[:n],
                 None if d.confidence is None else d.confidence[:n])


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    from adaptspec.engine.sampling import argmax_rows

    return argmax_rows(logits)


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose vocabulary or tokenizer differs from the target's."""
    tv, dv = target.model.cfg.vocab_size, draft.model.cfg.vocab_size
    if tv != dv:
        raise ValueError(f"draft: vocabulary size {dv} differs from the target's {tv}; "
                         "a draft must share the target's tokenizer")
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ValueError("draft: tokenizer differs from the target's (same size, different tokens)")


def _eos_ids(m: LoadedModel) -> set[int]:
    ids = set()
    tok_eos = getattr(m.tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        ids.add(int(tok_eos))
    return ids


def _per_prompt(x, n: int, name: str) -> list:
    if isinstance(x, list):
        if len(x) != n:
            raise ValueError(f"{name}: got {len(x)} values for {n} prompts")
        return x
    return [x] * n
