"""The suffix drafter (after SuffixDecoding, arXiv 2411.04975): continuations of the
longest matching suffix, from the request's own tokens AND from recent outputs of its class.

Prompt lookup (``NgramProposer``) only searches the request itself. Requests of one class
often repeat each other's structure (the same JSON keys, tool-call syntax, code
scaffolding), so the outputs of finished requests of the class are searched too.

The structure is an implicit suffix tree of bounded depth over token buffers. A node of a
suffix tree is a string ``s``; its count is the number of places ``s`` occurs with a token
after it, and its children are those next tokens. Here a node is represented by its
occurrence list: the positions where the context's last ``m`` tokens occur, found through
an index of every token's and every 2-gram's positions, then extended backwards
(vectorized) up to ``max_depth`` tokens. Why not a materialized tree (or a suffix automaton):

* memory is exactly bounded: 4 bytes per stored token plus its index entry, where a trie
  of depth D holds up to D Python nodes per token, and a suffix automaton has no deletion;
* eviction is trivial: a class keeps a ring of whole outputs under a token budget, the
  oldest output goes first (positions before the live window are skipped and the buffer
  is compacted once half of it is dead);
* a query is a few numpy operations over the occurrence list (capped to the most recent
  ``max_candidates``), not a Python walk.

Proposal (one chain, what the engine verifies): take the deepest node, i.e. the longest
suffix of the context (at most ``max_depth`` tokens; its last token alone only when no two
match anywhere, or never with ``min_match=2``) that occurs in either source with a
continuation, pooling the occurrences of both sources that match that deep.
Then repeatedly pick the most frequent next token (ties: the most recent occurrence's);
its confidence is count(chosen child) / count(node). Stop at ``k`` tokens or when the
confidence falls below ``min_confidence``; the chosen child becomes the node.

Exact like every drafter: the candidates are one-hot proposals the verifier checks.
"""
from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from adaptspec.engine.proposers import Draft, Proposer

_SEP = -1  # between documents of a buffer: no match or continuation crosses it


class TokenIndex:
    """A growable token buffer with the positions of every token and every 2-gram
    (``(a, b)`` at ``p - 1, p``)."""

    def __init__(self, capacity: int = 1024):
        self.buf = np.full(max(16, capacity), _SEP, dtype=np.int64)
        self.n = 0  # tokens in buf (separators included)
        self.start = 0  # positions before this are evicted (dead)
        self.grams: dict[tuple[int, int], list[int]] = {}
        self.ones: dict[int, list[int]] = {}

    def extend(self, tokens) -> None:
        tokens = np.asarray(tokens, dtype=np.int64)
        need = self.n + tokens.size
        if need > self.buf.size:
            cap = self.buf.size
            while cap < need:
                cap *= 2
            nb = np.full(cap, _SEP, dtype=np.int64)
            nb[:self.n] = self.buf[:self.n]
            self.buf = nb
        first = self.n
        self.buf[first:need] = tokens
        self.n = need
        b = self.buf
        for p in range(max(first, self.start), need):
            c = int(b[p])
            if c == _SEP:
                continue
            self.ones.setdefault(c, []).append(p)
            a = int(b[p - 1]) if p > self.start else _SEP
            if a != _SEP:
                self.grams.setdefault((a, c), []).append(p)

    def add_document(self, tokens) -> None:
        if self.n:
            self.extend([_SEP])
        self.extend(tokens)

    def matches(self, context: np.ndarray, max_depth: int, max_candidates: int,
                end: int | None = None, min_match: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Positions ``p`` where the context's last tokens occur, with a token after ``p``
        before ``end``, and how many of the context's last tokens match backwards from ``p``
        (up to ``max_depth``): the occurrences of its last 2 tokens, or where there are
        none (and ``min_match`` is 1) of its last token. Most recent ``max_candidates``."""
        end = self.n if end is None else end
        none = np.empty(0, np.int64), np.empty(0, np.int64)
        p = self._live(self.grams.get((int(context[-2]), int(context[-1]))) if context.size >= 2 else None,
                       max_candidates, end, 1)
        if p.size == 0 and min_match <= 1 and context.size >= 1:
            p = self._live(self.ones.get(int(context[-1])), max_candidates, end, 0)
        if p.size == 0:
            return none
        D = min(max_depth, context.size)
        offs = np.arange(D)
        idx = p[:, None] - offs[None, :]  # [n, D] positions compared with context[-1 - j]
        ok = idx >= self.start
        vals = self.buf[np.clip(idx, 0, None)]
        want = context[::-1][:D]
        eq = (vals == want[None, :]) & ok
        length = np.where(eq.all(1), D, np.argmin(eq, 1))  # leading run of matches
        return p, length

    def _live(self, pos: list[int] | None, max_candidates: int, end: int, back: int) -> np.ndarray:
        """The newest ``max_candidates`` of ``pos`` that are live (``back`` tokens before
        them too) and have a token after them before ``end``."""
        if not pos:
            return np.empty(0, np.int64)
        p = np.asarray(pos[-(max_candidates * 2):], dtype=np.int64)  # newest last; some may be dead or too late
        p = p[(p >= self.start + back) & (p + 1 < end)]
        return p[-max_candidates:]



class ClassStore:
    """Recent outputs of one request class, under a token budget (oldest evicted first)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.docs: deque[np.ndarray] = deque()
        self.starts: deque[int] = deque()  # buffer position of each stored output
        self.tokens = 0
        self.index = TokenIndex()

    def add(self, tokens: list[int]) -> None:
        if len(tokens) < 2:
            return
        doc = np.asarray(tokens[-self.max_tokens:], dtype=np.int64)
        self.starts.append(self.index.n + (1 if self.index.n else 0))
        self.index.add_document(doc)
        self.docs.append(doc)
        self.tokens += doc.size
        while self.tokens > self.max_tokens and len(self.docs) > 1:
            self.tokens -= self.docs.popleft().size
            self.starts.popleft()
            self.index.start = self.starts[0]  # everything before the oldest live output is dead
        if self.index.start > self.index.n // 2 and self.index.start > 4096:
            self._rebuild()

    def _rebuild(self) -> None:
        """Compact: a fresh index of the live outputs (amortized O(1) per stored token)."""
        self.index, self.starts = TokenIndex(2 * self.tokens), deque()
        for doc in self.docs:
            self.starts.append(self.index.n + (1 if self.index.n else 0))
            self.index.add_document(doc)


class SuffixProposer(Proposer):
    """Suffix-tree drafting over the request's prompt + output and its class's recent outputs."""

    name = "suffix"

    def __init__(self, max_depth: int = 24, min_confidence: float = 0.5, class_tokens: int = 32768,
                 max_classes: int = 64, max_candidates: int = 256, use_class: bool = True, min_match: int = 1):
        if max_depth < 2:
            raise ValueError(f"max_depth: must be >= 2, got {max_depth}")
        if min_match not in (1, 2):
            raise ValueError(f"min_match: must be 1 or 2, got {min_match}")
        self.min_match = min_match
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence: must be in [0, 1], got {min_confidence}")
        if class_tokens < 0 or max_classes < 1 or max_candidates < 1:
            raise ValueError("class_tokens >= 0, max_classes >= 1 and max_candidates >= 1 are required")
        self.max_depth, self.min_confidence = max_depth, min_confidence
        self.class_tokens, self.max_classes, self.max_candidates = class_tokens, max_classes, max_candidates
        self.use_class = use_class and class_tokens > 0
        self.classes: OrderedDict[str, ClassStore] = OrderedDict()  # least recently used first
        self._own: dict[int, TokenIndex] = {}  # id(seq) -> its own tokens, indexed

    # ---- engine hooks --------------------------------------------------------------
    def propose(self, seqs, ks) -> list[Draft]:
        out = []
        for s, k in zip(seqs, ks):
            floor = max(self.min_confidence, getattr(s.spec, "min_confidence", 0.0))
            toks, conf = self.draft(self._own_index(s), s.request_class, k, floor)
            d = Draft(toks)
            if hasattr(d, "confidence"):
                d.confidence = conf
            out.append(d)
        return out

    def release(self, seq) -> None:
        self._own.pop(id(seq), None)
        if self.use_class:
            self.observe_output(seq.request_class, list(seq.output_ids))

    # ---- the store and the query ---------------------------------------------------
    def observe_output(self, request_class: str, tokens: list[int]) -> None:
        """A finished output of ``request_class`` joins the class's store."""
        store = self.classes.get(request_class)
        if store is None:
            store = self.classes[request_class] = ClassStore(self.class_tokens)
            while len(self.classes) > self.max_classes:
                self.classes.popitem(last=False)
        self.classes.move_to_end(request_class)
        store.add(tokens)

    def _own_index(self, seq) -> TokenIndex:
        idx = self._own.get(id(seq))
        if idx is None:
            idx = self._own[id(seq)] = TokenIndex(2 * len(seq.token_ids))
        if idx.n < len(seq.token_ids):
            idx.extend(seq.token_ids[idx.n:])
        return idx

    def draft(self, own: TokenIndex, request_class: str, k: int,
              min_confidence: float | None = None) -> tuple[list[int], list[float]]:
        """Up to ``k`` tokens continuing ``own``'s tokens, with their confidences."""
        floor = self.min_confidence if min_confidence is None else min_confidence
        if k <= 0 or own.n < 2:
            return [], []
        ctx = own.buf[max(0, own.n - self.max_depth):own.n]
        sources = [(own, *own.matches(ctx, self.max_depth, self.max_candidates, end=own.n, min_match=self.min_match))]
        store = self.classes.get(request_class) if self.use_class else None
        if store is not None:
            sources.append((store.index, *store.index.matches(ctx, self.max_depth, self.max_candidates,
                                                              min_match=self.min_match)))
        deepest = max((int(length.max()) for _, _, length in sources if length.size), default=0)
        if deepest < self.min_match:
            return [], []
        occ = [(src, p[length >= deepest], own.n if src is own else src.n) for src, p, length in sources]
        toks: list[int] = []
        conf: list[float] = []
        for step in range(1, k + 1):
            nxt, keys = [], []
            for i, (src, p, end) in enumerate(occ):
                q = p + step
                t = np.full(p.size, _SEP, dtype=np.int64)
                valid = q < end
                t[valid] = src.buf[q[valid]]
                nxt.append(t)
                keys.append(p + (1 << 40 if i == 0 else 0))  # recency; the request's own occurrences first
            allt, allk = np.concatenate(nxt), np.concatenate(keys)
            live = allt != _SEP
            n_live = int(live.sum())
            if n_live == 0:
                break
            allt, allk = allt[live], allk[live]
            vals, counts = np.unique(allt, return_counts=True)
            best = int(counts.max())
            tied = vals[counts == best]
            if tied.size == 1:
                pick = int(tied[0])
            else:  # ties: the token of the most recent occurrence
                sel = np.isin(allt, tied)
                pick = int(allt[sel][np.argmax(allk[sel])])
            c = best / n_live
            if c < floor:
                break
            toks.append(pick)
            conf.append(c)
            occ = [(src, p[t == pick], end) for (src, p, end), t in zip(occ, nxt)]
        return toks, conf
