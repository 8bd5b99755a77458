"""The engine: continuous batching with exact speculative decoding. Ray-free.

One ``step()``: admit and prefill new requests, let each request's drafter propose its
``k`` candidates, verify every running request in ONE batched target pass, commit the
accepted tokens plus the recovered/bonus token, retire finished requests.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence as Seq

import torch

from adaptspec.engine.params import MAX_K, SamplingParams, SpecConfig
from adaptspec.engine.proposers import Draft, DraftModelProposer, HeadProposer, NgramProposer, Proposer
from adaptspec.engine.sampling import argmax_rows, logits_to_probs, sample_from_probs
from adaptspec.engine.scheduler import Scheduler
from adaptspec.engine.sequence import RequestOutput, Sequence, Status
from adaptspec.engine.stats import RequestStepStats, SpecStats, StepStats
from adaptspec.engine import verifier
from adaptspec.models.loader import LoadedHead, LoadedModel, load_draft, load_model

log = logging.getLogger("adaptspec.engine")


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 16  # KV slots: the most requests running at once
    max_model_len: int = 2048  # prompt + output (+ candidates) per slot
    ngram_max_n: int = 3
    ngram_min_n: int = 1

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2 * (MAX_K + 1):
            raise ValueError(f"max_model_len must be >= {2 * (MAX_K + 1)}, got {self.max_model_len}")


class Engine:
    def __init__(self, target: LoadedModel, draft: LoadedModel | LoadedHead | None = None,
                 config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.target, self.draft = target, draft
        self.tokenizer = target.tokenizer
        self.device = target.model.device
        cap = min(self.config.max_model_len, target.model.cfg.max_position)
        if draft is not None and draft.model.cfg.max_position < cap:  # its rotary tables end there
            log.warning("max_model_len %d -> %d: the draft %s has positions up to %d only", cap,
                        draft.model.cfg.max_position, draft.name, draft.model.cfg.max_position)
            cap = draft.model.cfg.max_position
        self.config.max_model_len = cap
        self.target.model.allocate_cache(self.config.max_num_seqs, cap)
        self.proposers: dict[str, Proposer] = {
            "ngram": NgramProposer(self.config.ngram_max_n, self.config.ngram_min_n)}
        if isinstance(draft, LoadedHead):  # a feature-level head drafts from the target's features
            draft.model.allocate_cache(self.config.max_num_seqs, cap)
            self.proposers["draft"] = HeadProposer(draft.model)
        elif draft is not None:
            check_same_vocab(target, draft)
            draft.model.allocate_cache(self.config.max_num_seqs, cap)
            self.proposers["draft"] = DraftModelProposer(draft.model)
        self._feature_sinks = [p for p in self.proposers.values() if p.wants_hidden]
        self.scheduler = Scheduler(self.config.max_num_seqs, cap)
        self.requests: dict[str, Sequence] = {}
        self.eos_ids = _eos_ids(target)
        self.step_count = 0
        self.drafter_errors = 0  # proposer calls that raised (their requests ran with k = 0)
        self.totals = SpecStats()
        self.last_step: StepStats | None = None
        self.step_listeners: list[Callable[[StepStats], None]] = []
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(cls, target: str = "smollm2-135m", draft: str | None = None, dtype="float32",
                        device="cpu", **config) -> "Engine":
        """Load models by alias, folder, .gguf or hub id. ``config``: EngineConfig fields."""
        cfg = EngineConfig(**config)
        t = load_model(target, dtype=dtype, device=device, quiet=True)
        d = load_draft(draft, t, dtype=dtype, device=device, quiet=True) if draft else None
        return cls(t, d, cfg)

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
                    request_class: str = "default", raw: bool = False) -> str:
        arrival = time.perf_counter()  # TTFT and e2e count tokenization (the chat template) too
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
        self.scheduler.remove_waiting(seq)
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
        outputs: dict[str, RequestOutput] = {}
        admitted = self.scheduler.schedule()
        prefill_tokens = self._prefill(admitted, outputs)
        t1 = self._sync_time()
        batch = [s for s in self.scheduler.running if not s.finished]
        ks = [self._effective_k(s) for s in batch]
        drafts = self._propose(batch, ks)
        t2 = self._sync_time()
        context = sum(s.num_computed for s in batch)
        emitted, hidden = self._verify(batch, drafts)
        t3 = self._sync_time()
        req_stats = self._commit(batch, ks, drafts, emitted, hidden, outputs)
        for seq in [s for s in self.scheduler.running if s.finished]:
            self.scheduler.free(seq)
            self.requests.pop(seq.request_id, None)
        t4 = time.perf_counter()
        self._record(StepStats(self.step_count, len(batch), len(admitted), prefill_tokens,
                               sum(len(d.token_ids) + 1 for d in drafts), context, len(self.scheduler.waiting),
                               t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0, req_stats))
        return list(outputs.values())

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
    def _prefill(self, seqs: list[Sequence], outputs: dict) -> int:
        if not seqs:
            return 0
        m, dev = self.target.model, self.device
        T = max(len(s.token_ids) for s in seqs)
        ids = torch.zeros(len(seqs), T, dtype=torch.long, device=dev)
        for r, s in enumerate(seqs):
            ids[r, :len(s.token_ids)] = torch.tensor(s.token_ids)
        lens = [len(s.token_ids) for s in seqs]
        last = torch.tensor([r * T + n - 1 for r, n in enumerate(lens)], device=dev)
        logits, hidden = m.forward(ids, [s.slot for s in seqs], [0] * len(seqs), lens, last)
        for prop in self._feature_sinks:
            for r, s in enumerate(seqs):
                prop.observe_hidden(s, 0, hidden[r, :lens[r]])
        first = self._sample_rows(seqs, logits)
        now = time.perf_counter()
        for s, tok in zip(seqs, first):
            s.num_computed = len(s.token_ids)
            s.first_token_s = now
            self._append(s, [tok], outputs)
        return sum(lens)

    def _effective_k(self, s: Sequence) -> int:
        if not s.spec.speculates:
            return 0
        return max(0, min(s.spec.k, s.remaining - 1))

    def _propose(self, batch: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in batch]
        by_drafter: dict[str, list[int]] = {}
        for i, (s, k) in enumerate(zip(batch, ks)):
            if k > 0:
                by_drafter.setdefault(s.spec.drafter, []).append(i)
        for name, idx in by_drafter.items():
            prop, seqs = self.proposers[name], [batch[i] for i in idx]
            try:
                proposed = prop.propose(seqs, [ks[i] for i in idx])
            except Exception:  # a failing drafter means k = 0 for its requests, never a lost request
                log.exception("drafter %r failed; its %d requests decode plainly this step", name, len(idx))
                self.drafter_errors += 1
                for s in seqs:  # nothing drafted was accepted: roll the drafter's state back
                    prop.on_verified(s, len(s.token_ids), 0, None)
                proposed = [Draft([]) for _ in idx]
            for i, d in zip(idx, proposed):
                drafts[i] = d
        return drafts

    def _verify(self, batch: list[Sequence], drafts: list[Draft]):
        """ONE batched target pass over every running request; returns per-request emitted tokens."""
        if not batch:
            return [], None
        dev, m = self.device, self.target.model
        n = [len(d.token_ids) for d in drafts]
        T = max(n) + 1
        ids = torch.zeros(len(batch), T, dtype=torch.long, device=dev)
        for r, (s, d) in enumerate(zip(batch, drafts)):
            ids[r, :n[r] + 1] = torch.tensor([s.token_ids[-1], *d.token_ids])
        rows = torch.tensor([r * T + j for r in range(len(batch)) for j in range(n[r] + 1)], device=dev)
        logits, hidden = m.forward(ids, [s.slot for s in batch], [s.num_computed for s in batch],
                                   [k + 1 for k in n], rows)  # logits [sum(n_i + 1), vocab]
        emitted: list[list[int]] = [[] for _ in batch]
        groups = {True: [], False: []}
        for r, s in enumerate(batch):
            groups[s.params.greedy].append(r)
        row_start = [0]
        for k in n:
            row_start.append(row_start[-1] + k + 1)
        for greedy, members in groups.items():
            if not members:
                continue
            if len(members) == len(batch):
                sub_logits = logits
            else:
                sel = torch.tensor([row_start[r] + j for r in members for j in range(n[r] + 1)], device=dev)
                sub_logits = logits.index_select(0, sel)
            if greedy and dev.type == "cpu":  # on the host: argmax through numpy, no tensor ops
                for r, toks in zip(members, verifier.verify_greedy_host(argmax_rows(sub_logits),
                                                                        [drafts[r].token_ids for r in members])):
                    emitted[r] = toks
                continue
            draft_ids = torch.tensor([t for r in members for t in drafts[r].token_ids], dtype=torch.long, device=dev)
            num_draft = torch.tensor([n[r] for r in members], dtype=torch.long, device=dev)
            max_k = max(n[r] for r in members)
            if greedy:
                res = verifier.verify_greedy_dispatch(sub_logits, draft_ids, num_draft, max_num_draft_tokens=max_k)
            else:
                res = self._verify_stochastic([batch[r] for r in members], [drafts[r] for r in members],
                                              sub_logits, draft_ids, num_draft, max_k)
            host = torch.cat([res.num_accepted[:, None], res.output_token_ids], 1).tolist()  # one sync
            for r, (a, *o) in zip(members, host):
                emitted[r] = o[:a + 1]
        return emitted, hidden

    def _verify_stochastic(self, seqs, drafts, logits, draft_ids, num_draft, max_k):
        """Temperature / top-k / top-p per request, then exact verification (Triton on CUDA)."""
        dev, vocab = self.device, logits.shape[-1]
        q = None
        if any(d.probs is not None for d in drafts):  # n-gram rows inside a model-draft batch: one-hot q
            q = torch.cat([d.probs.to(dev) if d.probs is not None else
                           torch.zeros(len(d.token_ids), vocab, device=dev).scatter_(
                               1, torch.tensor(d.token_ids, device=dev)[:, None], 1.0) for d in drafts])
        u = [torch.rand(len(d.token_ids) + 1, generator=s.generator) for s, d in zip(seqs, drafts)]
        u_accept = torch.cat([x[:-1] for x in u]).to(dev)
        u_sample = torch.stack([x[-1] for x in u]).to(dev)
        temperature, top_k, top_p = self._param_tensors(seqs)
        any_top_k = any(s.params.top_k > 0 for s in seqs)  # decided on the host: no device sync
        any_top_p = any(s.params.top_p < 1.0 for s in seqs)
        return verifier.verify_stochastic_from_logits_dispatch(
            logits, temperature, top_k if any_top_k else None, top_p if any_top_p else None,
            draft_ids, q, num_draft, u_accept, u_sample, max_num_draft_tokens=max_k)

    def _param_tensors(self, seqs: list[Sequence]):  # three [num_reqs] tensors
        dev = self.device
        return (torch.tensor([s.params.temperature for s in seqs], device=dev),
                torch.tensor([s.params.top_k for s in seqs], device=dev),
                torch.tensor([s.params.top_p for s in seqs], device=dev))

    def _sample_rows(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:  # logits [B, vocab]
        out = argmax_rows(logits)
        stoch = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if stoch:
            sub = [seqs[i] for i in stoch]
            probs = logits_to_probs(logits[stoch], *self._param_tensors(sub))
            u = torch.cat([torch.rand(1, generator=s.generator) for s in sub]).to(self.device)
            for i, tok in zip(stoch, sample_from_probs(probs, u).tolist()):
                out[i] = tok
        return out

    def _commit(self, batch, ks, drafts, emitted, hidden, outputs) -> list[RequestStepStats]:
        stats = []
        for r, (s, k, d, toks) in enumerate(zip(batch, ks, drafts, emitted)):
            before, accepted = len(s.token_ids), len(toks) - 1
            s.num_computed = before + accepted
            for sink in self._feature_sinks:  # the target's features at positions before-1 ..
                sink.observe_hidden(s, before - 1, hidden[r, :accepted + 1])
            prop = self.proposers.get(s.spec.drafter)
            if prop is not None and k > 0:
                h = hidden[r, :accepted + 1] if prop.wants_hidden else None
                prop.on_verified(s, before, accepted, h)
            n_emitted = self._append(s, toks, outputs)
            # accepted = drafted tokens kept: none past an EOS or stop string that ended the request
            rs = RequestStepStats(s.request_id, s.request_class, s.spec.drafter if k else "none", k,
                                  len(d.token_ids), min(accepted, n_emitted), n_emitted)
            s.stats.observe_step(rs)
            self.totals.observe_step(rs)
            stats.append(rs)
        return stats

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
        out = outputs.get(s.request_id)
        if out is None:
            outputs[s.request_id] = self._output(s, new)
        else:
            out.new_token_ids += new
            out.token_ids, out.finished, out.finish_reason = s.output_ids, s.finished, s.finish_reason
            if s.finished:
                outputs[s.request_id] = self._output(s, out.new_token_ids)
        return len(new)

    def _hit_stop(self, s: Sequence) -> bool:
        text = self.tokenizer.decode(s.output_ids[-64:], skip_special_tokens=True)
        return any(st in text for st in s.params.stop)

    def _finish(self, s: Sequence, reason: str) -> None:
        if s.status is Status.FINISHED:
            return
        s.status, s.finish_reason, s.finish_s = Status.FINISHED, reason, time.perf_counter()
        s.stats.wall_s = s.finish_s - s.arrival_s
        for prop in self.proposers.values():
            prop.release(s)
        if reason == "abort" and s in self.scheduler.running:
            self.scheduler.free(s)

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

    def _sync_time(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _record(self, st: StepStats) -> None:
        self.step_count += 1
        self.last_step = st
        for fn in self.step_listeners:
            fn(st)


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
