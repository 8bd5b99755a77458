"""Drafters (proposers): they only propose; the verifier alone decides.

The interface is narrow on purpose:

* ``propose(seqs, ks) -> list[Draft]``: up to ``ks[i]`` candidate tokens for each
  sequence, with the draft distribution ``q`` for each candidate when sampling needs it
  (``None`` means one-hot: the candidate had probability 1 under the drafter).
* ``on_verified(seq, num_tokens_before, num_accepted, hidden)``: after the verification
  pass; ``hidden`` holds the target's final hidden states at the positions the step
  verified up to the last accepted one (``[num_accepted + 1, hidden_size]``), at no extra
  cost. A model drafter rolls its KV length back here; a feature-level draft head (the
  co-design issue) keeps the features to draft from next step.
* ``release(seq)``: the sequence left the engine.

``wants_hidden`` tells the engine whether to slice hidden states for this proposer. Such a
proposer also gets ``observe_hidden(seq, position, hidden)`` for EVERY running sequence at
prefill and after every verification, whichever drafter the sequence uses at the time, so a
request the controller switches to the head mid-way has its features.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adaptspec.engine.sampling import argmax_rows, logits_to_probs, sample_from_probs
from adaptspec.engine.sequence import Sequence
from adaptspec.models.llama import LlamaModel


@dataclass(slots=True)
class Draft:
    token_ids: list[int]  # [n] candidates, n <= k
    probs: torch.Tensor | None = None  # [n, vocab_size] q for stochastic requests; None = one-hot


class Proposer:
    name = "base"
    wants_hidden = False

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        raise NotImplementedError

    def on_verified(self, seq: Sequence, num_tokens_before: int, num_accepted: int,
                    hidden: torch.Tensor | None) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def observe_hidden(self, seq: Sequence, position: int, hidden: torch.Tensor) -> None:
        """The target's features at ``position ..`` (only for ``wants_hidden`` proposers)."""


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the longest suffix (up to
    ``max_n`` tokens, at least ``min_n``) in prompt + output and propose what followed."""

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        return [Draft(self.lookup(s.token_ids, k)) for s, k in zip(seqs, ks)]

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
    """A smaller model with the target's tokenizer and its own KV slots (same slot ids)."""

    name = "draft"

    def __init__(self, model: LlamaModel):
        self.model = model

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        m, dev = self.model, self.model.device
        behind = [s for s in seqs if len(s.token_ids) - s.draft_computed > 2]
        if behind:  # catch up long unfed stretches (new requests, drafter switches) in one pass
            chunks = [s.token_ids[s.draft_computed:-1] for s in behind]
            T = max(len(c) for c in chunks)
            ids = torch.zeros(len(behind), T, dtype=torch.long, device=dev)
            for r, c in enumerate(chunks):
                ids[r, :len(c)] = torch.tensor(c)
            m.forward(ids, [s.slot for s in behind], [s.draft_computed for s in behind],
                      [len(c) for c in chunks], logits_rows=torch.zeros(1, dtype=torch.long, device=dev))
            for s in behind:
                s.draft_computed = len(s.token_ids) - 1
        drafts = [Draft([], None) for _ in seqs]
        stoch_probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        inputs = [s.token_ids[s.draft_computed:] for s in seqs]  # 1 or 2 unfed tokens each
        active = [i for i, k in enumerate(ks) if k > 0]
        for step in range(max(ks, default=0)):
            active = [i for i in active if ks[i] > step]
            if not active:
                break
            rows = [seqs[i] for i in active]
            T = max(len(inputs[i]) for i in active)
            ids = torch.zeros(len(active), T, dtype=torch.long, device=dev)
            for r, i in enumerate(active):
                ids[r, :len(inputs[i])] = torch.tensor(inputs[i])
            n_tok = [len(inputs[i]) for i in active]
            last = torch.tensor([r * T + n - 1 for r, n in enumerate(n_tok)], device=dev)
            logits, _ = m.forward(ids, [s.slot for s in rows], [s.draft_computed for s in rows], n_tok, last)
            for s, n in zip(rows, n_tok):
                s.draft_computed += n
            tokens = self._sample(rows, logits, [stoch_probs[i] for i in active])
            for r, i in enumerate(active):
                drafts[i].token_ids.append(tokens[r])
                inputs[i] = [tokens[r]]
        for i, d in enumerate(drafts):
            if stoch_probs[i]:
                d.probs = torch.stack(stoch_probs[i])
        return drafts

    def _sample(self, rows: list[Sequence], logits: torch.Tensor,  # [num_rows, vocab_size]
                probs_out: list[list[torch.Tensor]]) -> list[int]:
        greedy = [s.params.greedy for s in rows]
        out = argmax_rows(logits)
        if all(greedy):
            return out
        idx = [r for r, g in enumerate(greedy) if not g]
        sub = [rows[r] for r in idx]
        dev = logits.device
        probs = logits_to_probs(
            logits[idx],
            torch.tensor([s.params.temperature for s in sub], device=dev),
            torch.tensor([s.params.top_k for s in sub], device=dev),
            torch.tensor([s.params.top_p for s in sub], device=dev),
        )
        u = torch.cat([torch.rand(1, generator=s.generator, device=s.generator.device) for s in sub]).to(dev)
        tok = sample_from_probs(probs, u).tolist()
        for j, r in enumerate(idx):
            out[r] = tok[j]
            probs_out[r].append(probs[j])
        return out

    def on_verified(self, seq, num_tokens_before, num_accepted, hidden) -> None:
        # the draft fed its own candidates; those past the first rejection are invalid
        seq.draft_computed = min(seq.draft_computed, num_tokens_before + num_accepted)

    def release(self, seq) -> None:
        seq.draft_computed = 0


def _pending_end(seq: Sequence) -> int:
    """The position after the last target feature the head has not consumed yet."""
    return seq.head_pending_from + sum(h.shape[0] for h in seq.head_pending)


class HeadProposer(Proposer):
    """A feature-level draft head (EAGLE-style, ``adaptspec.distill.head``).

    Head entry ``j`` holds (target feature f_j, token x_{j+1}). Before drafting, the
    target features observed since the last step are fed as one batched pass; its last
    entry predicts the first candidate. Each further candidate feeds the head's own
    feature and the previous candidate. Candidates past the first rejection are never
    committed: ``head_computed`` only advances over target features, so the next feed
    overwrites them.
    """

    name = "draft"
    wants_hidden = True

    def __init__(self, head):  # adaptspec.distill.head.HeadModel
        self.head = head

    def observe_hidden(self, seq, position, hidden) -> None:
        if seq.head_broken:
            return
        if not seq.head_pending:
            seq.head_pending_from = seq.head_computed
        expected = _pending_end(seq)
        if position != expected:  # cannot happen when every step is observed; never guess
            seq.head_broken, seq.head_pending = True, []
            return
        seq.head_pending.append(hidden.detach().clone())

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        head, dev = self.head, self.head.device
        drafts = [Draft([], None) for _ in seqs]
        active = [i for i, (s, k) in enumerate(zip(seqs, ks)) if k > 0 and not s.head_broken
                  and s.head_pending and _pending_end(s) == len(s.token_ids) - 1]
        if not active:
            return drafts
        rows = [seqs[i] for i in active]
        feats = [torch.cat(s.head_pending) for s in rows]
        n_tok = [f.shape[0] for f in feats]
        T = max(n_tok)
        H = feats[0].shape[1]
        F_in = torch.zeros(len(rows), T, H, dtype=head.compute_dtype, device=dev)
        ids = torch.zeros(len(rows), T, dtype=torch.long, device=dev)
        for r, (s, f) in enumerate(zip(rows, feats)):
            F_in[r, :f.shape[0]] = f.to(dev, head.compute_dtype)
            start = s.head_pending_from
            ids[r, :f.shape[0]] = torch.tensor(s.token_ids[start + 1:start + 1 + f.shape[0]])
        last = torch.tensor([r * T + n - 1 for r, n in enumerate(n_tok)], device=dev)
        logits, g = head.forward(F_in, ids, [s.slot for s in rows], [s.head_pending_from for s in rows], n_tok, last)
        for s, n in zip(rows, n_tok):
            s.head_computed = s.head_pending_from + n
            s.head_pending = []
        g_last = g.reshape(-1, H).index_select(0, last)  # [R, H]
        stoch: list[list[torch.Tensor]] = [[] for _ in seqs]
        step = 0
        while True:
            tokens = self._sample(rows, logits, [stoch[i] for i in active])
            for r, i in enumerate(active):
                drafts[i].token_ids.append(tokens[r])
            step += 1
            keep = [r for r, i in enumerate(active) if ks[i] > step]
            if not keep:
                break
            active = [active[r] for r in keep]
            sel = torch.tensor(keep, device=dev)
            g_last = g_last.index_select(0, sel)
            rows = [rows[r] for r in keep]
            nxt = torch.tensor([[tokens[r]] for r in keep], device=dev)
            logits, g = head.forward(g_last[:, None], nxt, [s.slot for s in rows],
                                     [s.head_computed + step - 1 for s in rows], [1] * len(rows))
            g_last = g[:, 0]
        for i, d in enumerate(drafts):
            if stoch[i]:
                d.probs = head.full_probs(torch.stack(stoch[i]))
        return drafts

    def _sample(self, rows: list[Sequence], logits: torch.Tensor, probs_out: list[list[torch.Tensor]]) -> list[int]:
        head = self.head
        draft_ids = argmax_rows(logits)
        out = head.vocab_list_ids(draft_ids)
        idx = [r for r, s in enumerate(rows) if not s.params.greedy]
        if not idx:
            return out
        sub = [rows[r] for r in idx]
        dev = logits.device
        probs = logits_to_probs(logits[idx].float(),
                                torch.tensor([s.params.temperature for s in sub], device=dev),
                                torch.tensor([s.params.top_k for s in sub], device=dev),
                                torch.tensor([s.params.top_p for s in sub], device=dev))
        u = torch.cat([torch.rand(1, generator=s.generator, device=s.generator.device) for s in sub]).to(dev)
        tok = head.to_target_ids(sample_from_probs(probs, u)).tolist()
        for j, r in enumerate(idx):
            out[r] = tok[j]
            probs_out[r].append(probs[j])
        return out

    def release(self, seq) -> None:
        seq.head_computed, seq.head_pending, seq.head_pending_from, seq.head_broken = 0, [], 0, False
