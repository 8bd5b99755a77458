"""Drafters (proposers): they only propose; the verifier alone decides.

The interface is narrow on purpose:

* ``propose(seqs, ks) -> list[Draft]``: up to ``ks[i]`` candidate tokens for each
  sequence, with the draft distribution ``q`` for each candidate when sampling needs it
  (``None`` means one-hot: the candidate had probability 1 under the drafter), and the
  drafter's confidence in each candidate when it has one. A request's
  ``spec.min_confidence`` asks to stop drafting at the first candidate below it.
* ``on_verified(seq, num_tokens_before, num_accepted, hidden)``: after the verification
  pass (``hidden`` is unused and kept for drafters written against the first interface). A
  model drafter rolls its KV length back here.
* ``on_admit(seq)``: the sequence joined the running batch, its first
  ``seq.num_computed`` positions possibly reused from the prefix cache.
* ``release(seq)``: the sequence left the engine.

``wants_features`` drafters (a feature-level head) also get ``observe(seqs, starts,
counts, features)`` after EVERY step, for every running sequence whichever drafter it uses:
the target's features at the positions the step committed, so the head's KV is always
complete (a request the controller switches to the head mid-way has its context, and a
block shared through the prefix cache carries the head's entries too).

The model drafters' passes go through ``_run``: with the engine's draft graphs
(``models.cuda_graph.GraphRunner``, ``EngineConfig.cuda_graphs``) a pass of decode-sized rows
that fits replays the bucket's graph; a pass with a row of more than ``MAX_K + 1`` tokens (a
prompt, or a request catching up after drafting with another arm) runs eagerly on its exact
batch. Sampling stays outside the graphs: it
reads the candidates back to the host (one transfer per pass) and draws from each request's
own host generator.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adaptspec.engine.params import MAX_K
from adaptspec.engine.sampling import argmax_rows, logits_to_probs, sample_from_probs
from adaptspec.engine.sequence import Sequence
from adaptspec.models.batch import FlatBatch
from adaptspec.models.cuda_graph import GraphRunner
from adaptspec.models.llama import LlamaModel


@dataclass(slots=True)
class Draft:
    token_ids: list[int]  # [n] candidates, n <= k
    probs: torch.Tensor | None = None  # [n, vocab_size] q for stochastic requests; None = one-hot
    confidence: list[float] | None = None  # [n] the drafter's probability of each candidate


class Proposer:
    name = "base"
    wants_features = False

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        raise NotImplementedError

    def on_verified(self, seq: Sequence, num_tokens_before: int, num_accepted: int,
                    hidden: torch.Tensor | None = None) -> None:
        pass

    def on_admit(self, seq: Sequence) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def observe(self, seqs: list[Sequence], starts: list[int], counts: list[int],
                features: torch.Tensor) -> None:
        """``features[starts[i]:starts[i] + counts[i]]`` are ``seqs[i]``'s target features at
        its newly committed positions (only for ``wants_features`` proposers)."""


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the longest suffix (up to
    ``max_n`` tokens, at least ``min_n``) in prompt + output and propose what followed."""

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        out = []
        for s, k in zip(seqs, ks):
            toks = self.lookup(s.token_ids, k)
            out.append(Draft(toks, None, [1.0] * len(toks)))
        return out

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < 2:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        L = arr.size
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = arr[L - n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)  # starts 0..L-1-n
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            hits = hits[hits + n < L]  # something must follow the match
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []


class DraftModelProposer(Proposer):
    """A smaller model with the target's tokenizer; its paged KV uses the target's block ids.

    It feeds whatever it has not seen yet (the prompt on a first call, the tokens the last
    step emitted) in the first drafting pass, one flattened forward over every sequence, then
    one token per pass. Candidates past the first rejection are forgotten by rolling
    ``draft_computed`` back."""

    name = "draft"

    def __init__(self, model: LlamaModel, graphs: GraphRunner | None = None):
        self.model = model
        self.graphs = graphs  # the draft's CUDA graphs (the engine sets them up), None: eager

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        m = self.model
        drafts = [Draft([], None, []) for _ in seqs]
        stoch: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        rows = [seqs[i].token_ids[seqs[i].draft_computed:] for i in active]
        step = 0
        while active:
            logits, _ = _run(m, self.graphs, rows, [seqs[i].draft_computed for i in active],
                             [seqs[i] for i in active], True, lambda batch: m.forward(batch))
            for i, r in zip(active, rows):
                seqs[i].draft_computed += len(r)
            sel = [seqs[i] for i in active]
            tokens, conf = _sample(sel, logits, [stoch[i] for i in active])
            for r, i in enumerate(active):
                drafts[i].token_ids.append(tokens[r])
                drafts[i].confidence.append(conf[r])
            step += 1
            keep = [r for r, i in enumerate(active) if ks[i] > step and conf[r] >= seqs[i].spec.min_confidence]
            active, rows = [active[r] for r in keep], [[tokens[r]] for r in keep]
        for i, d in enumerate(drafts):
            if stoch[i]:
                d.probs = torch.stack(stoch[i])
        return drafts

    def on_verified(self, seq, num_tokens_before, num_accepted, hidden=None) -> None:
        # the draft fed its own candidates; those past the first rejection are invalid
        seq.draft_computed = min(seq.draft_computed, num_tokens_before + num_accepted)

    def on_admit(self, seq) -> None:
        seq.draft_computed = 0  # the draft's KV of a reused prefix may be missing: recompute it

    def release(self, seq) -> None:
        seq.draft_computed = 0


def _run(model, graphs: GraphRunner | None, rows: list[list[int]], starts: list[int], seqs: list[Sequence],
         last: bool, eager, inputs: torch.Tensor | None = None):
    """One drafting pass: ``rows`` fed at positions ``starts`` through the sequences' block
    tables, logits at each row's last token when ``last``. Replays a graph (``graphs``) when
    every row is decode-sized and the pass fits; else ``eager(FlatBatch)`` on the exact batch.
    ``inputs`` [num_tokens, width]: per-row float inputs (a head's), which a graph takes
    through its static buffer and ``eager`` already holds."""
    logit_rows, at = [], 0
    for r in rows:
        at += len(r)
        logit_rows.append(at - 1)
    logit_rows = logit_rows if last else []
    tables = [s.block_table for s in seqs]
    if graphs is not None and max(map(len, rows)) <= MAX_K + 1 and \
            graphs.fits(at, len(rows), max(map(len, tables))):
        return graphs.forward(rows, starts, tables, logit_rows, inputs)
    return eager(FlatBatch.build(rows, starts, tables, logit_rows, model.block_size, model.device))


def _sample(rows: list[Sequence], logits: torch.Tensor,  # [num_rows, vocab_size]
            probs_out: list[list[torch.Tensor]], to_target=None) -> tuple[list[int], list[float]]:
    """Each row's candidate (argmax when greedy, a draw from the processed draft distribution
    otherwise) and the drafter's probability of it. ``to_target`` maps draft-vocabulary ids."""
    dev = logits.device
    greedy = [r for r, s in enumerate(rows) if s.params.greedy]
    out = [0] * len(rows)
    conf = [1.0] * len(rows)
    if greedy:
        sub = logits if len(greedy) == len(rows) else logits[greedy]
        p = torch.softmax(sub.float(), -1)
        top = p.max(-1)
        # one transfer for every row's id and probability (float64 holds the ids exactly)
        ids, vals = torch.stack([top.indices.double(), top.values.double()]).tolist()
        for j, r in enumerate(greedy):
            out[r], conf[r] = int(ids[j]), vals[j]
    idx = [r for r in range(len(rows)) if not rows[r].params.greedy]
    if idx:
        sub = [rows[r] for r in idx]
        probs = logits_to_probs(logits[idx].float(),
                                torch.tensor([s.params.temperature for s in sub], device=dev),
                                torch.tensor([s.params.top_k for s in sub], device=dev),
                                torch.tensor([s.params.top_p for s in sub], device=dev),
                                max_top_k=max(s.params.top_k for s in sub),
                                any_top_p=any(s.params.top_p < 1.0 for s in sub))
        u = torch.cat([torch.rand(1, generator=s.generator, device=s.generator.device) for s in sub]).to(dev)
        tok = sample_from_probs(probs, u)
        ids, pt = torch.stack([tok.double(), probs.gather(1, tok[:, None])[:, 0].double()]).tolist()
        for j, r in enumerate(idx):
            out[r], conf[r] = int(ids[j]), pt[j]
            probs_out[r].append(probs[j])
    if to_target is not None:
        out = to_target(out)
    return out, conf


class HeadProposer(Proposer):
    """A feature-level draft head (EAGLE-style, ``adaptspec.models.head``).

    Head entry ``j`` holds (target feature f_j, token x_{j+1}). After every step the engine
    hands over the features of the positions it committed (``observe``) and they are fed in
    one batched pass; the head's output at the last entry (``seq.head_last``) drafts the
    first candidate. Each further candidate feeds the head's own output and the previous
    candidate at the next position; those entries lie past the committed positions and the
    next ``observe`` overwrites them.
    """

    name = "draft"
    wants_features = True

    def __init__(self, head, graphs: GraphRunner | None = None):  # adaptspec.models.head.HeadModel
        self.head = head
        # CUDA graphs of head.step (the engine sets them up; None: eager): one input width, H,
        # for the feature passes (observe) and the fed-back ones (propose) alike
        self.graphs = graphs

    def _pass(self, rows, starts, seqs, last: bool, x: torch.Tensor, from_target: bool):
        """One pass of the head (graphed where it fits): ``x`` [num_tokens, F or H]."""
        head = self.head
        u = head.input_of(x, from_target)  # the input layer stays eager: a graph takes one width
        return _run(head.decoder, self.graphs, rows, starts, seqs, last, lambda batch: head.step(u, batch), u)

    def on_admit(self, seq) -> None:
        seq.head_fed, seq.head_last = seq.num_computed, None  # reused blocks carry the head's entries

    def observe(self, seqs, starts, counts, features) -> None:
        head = self.head
        live = [i for i, s in enumerate(seqs) if counts[i] > 0 and s.head_fed == s.num_computed - counts[i]]
        for i, s in enumerate(seqs):
            if i not in live and counts[i] > 0:  # a gap in the features: this request cannot use the head
                s.head_fed, s.head_last = -1, None
        if not live:
            return
        sel = [seqs[i] for i in live]
        rows = [s.token_ids[s.head_fed + 1:s.head_fed + 1 + counts[i]] for i, s in zip(live, sel)]
        dev = features.device
        # queued copies, never waiting: the index of each request's last row is on the device
        # before the pass is (a blocking copy after it would wait for the pass)
        idx = torch.cat([torch.arange(starts[i], starts[i] + counts[i]) for i in live]).to(dev, non_blocking=True)
        ends = torch.from_numpy(np.cumsum([counts[i] for i in live]) - 1).to(dev, non_blocking=True)
        _, g = self._pass(rows, [s.head_fed for s in sel], sel, False, features.index_select(0, idx), True)
        last = g.index_select(0, ends)  # a copy: g may be a graph's output, which the next pass overwrites
        for j, (i, s) in enumerate(zip(live, sel)):
            s.head_fed += counts[i]
            s.head_last = last[j]

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        head = self.head
        drafts = [Draft([], None, []) for _ in seqs]
        active = [i for i, (s, k) in enumerate(zip(seqs, ks))
                  if k > 0 and s.head_last is not None and s.head_fed == s.num_computed]
        if not active:
            return drafts
        stoch: list[list[torch.Tensor]] = [[] for _ in seqs]
        g_last = torch.stack([seqs[i].head_last for i in active])  # [R, H]
        logits = head.logits_of(g_last)
        step = 0
        while True:
            sel = [seqs[i] for i in active]
            tokens, conf = _sample(sel, logits, [stoch[i] for i in active], head.vocab_list_ids)
            for r, i in enumerate(active):
                drafts[i].token_ids.append(tokens[r])
                drafts[i].confidence.append(conf[r])
            step += 1
            keep = [r for r, i in enumerate(active) if ks[i] > step and conf[r] >= seqs[i].spec.min_confidence]
            if not keep:
                break
            active = [active[r] for r in keep]
            g_last = g_last.index_select(0, torch.tensor(keep, device=g_last.device))
            sel = [seqs[i] for i in active]
            logits, g_last = self._pass([[tokens[r]] for r in keep], [s.head_fed + step - 1 for s in sel], sel,
                                        True, g_last, False)
        for i, d in enumerate(drafts):
            if stoch[i]:
                d.probs = head.full_probs(torch.stack(stoch[i]))
        return drafts

    def release(self, seq) -> None:
        seq.head_fed, seq.head_last = 0, None
