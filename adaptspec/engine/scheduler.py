"""Continuous batching with chunked prefill under a token budget, over the paged KV cache.

Each step has ``max_num_batched_tokens``. Running requests whose prompt is in go first, each
with its last token plus up to ``k`` drafted ones (the ``k`` shrinks when the budget is
short); prompts (new requests, and the rest of partly prefilled ones) fill what is left in
chunks. So a long prompt never holds running requests for more than one budgeted step.
When the KV pool cannot grow a running request, the youngest request is preempted: its
blocks go back (full ones stay in the prefix cache) and it waits at the queue's head to be
recomputed, its generated tokens kept.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from adaptspec.engine.kv_cache import KVCacheManager
from adaptspec.engine.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledRow:
    seq: Sequence
    num_new: int  # positions fed this step from seq.num_computed (its uncomputed tail, or a chunk of it)
    k: int  # candidates it may draft (only rows whose tail is the last token)
    decode: bool = False  # a running request's decode / verification row (not a prompt chunk)

    @property
    def samples(self) -> bool:
        """Whether the row reaches the sequence's last token, so its logits give new tokens."""
        return self.seq.num_computed + self.num_new == len(self.seq.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    rows: list[ScheduledRow] = field(default_factory=list)  # decode rows first, then prompt chunks
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    prompts_held: bool = False  # ``prompt_cap`` cut the prompt work this step could have carried

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new + r.k for r in self.rows)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 on_admit: Callable[[Sequence], None] | None = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.on_admit = on_admit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: preemption takes the youngest
        self.num_preempted = 0

    @property
    def free_seqs(self) -> int:
        """Requests that can join the running batch now."""
        return self.max_num_seqs - len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, k_of: Callable[[Sequence], int],
                 prompt_cap: Callable[[list[ScheduledRow], int, list[Sequence]], int] | None = None,
                 prompt_key: Callable[[Sequence], float] | None = None) -> SchedulerOutput:
        """The step's rows. ``prompt_cap(decode rows, budget left, prompt work in the order it is
        served)``: at most how many of the budget's remaining tokens prompt chunks may take
        (TPOT-paced prefill; None: all). ``prompt_key``: serve prompt work (partly prefilled
        requests, then admissions) in this order, smallest first, instead of admission order
        (with pacing: earliest deadline; the waiting queue keeps that order)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decoding = [s for s in self.running if not s.prefilling]
        spare = budget - len(decoding)  # each decode row's own token is always scheduled
        for s in decoding:
            if s.status is not Status.RUNNING:  # preempted for an older request in this loop
                continue
            k = max(0, min(k_of(s), spare))
            while not self.kv.can_grow(s, s.num_computed + 1 + k):
                if k > 0:
                    k = 0
                    continue
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is s:
                    break
            if s.status is not Status.RUNNING:
                continue
            self.kv.grow(s, s.num_computed + 1 + k)
            spare -= k
            out.rows.append(ScheduledRow(s, 1, k, True))
        budget -= sum(r.num_new + r.k for r in out.rows)
        prefilling = [s for s in self.running if s.prefilling]
        if prompt_key is not None:
            prefilling.sort(key=prompt_key)
            ordered = sorted(self.waiting, key=prompt_key)  # stable: ties keep the queue's order
            self.waiting.clear()
            self.waiting.extend(ordered)
        if prompt_cap is not None and budget > 0 and out.rows:
            cap = prompt_cap(out.rows, budget, [*prefilling, *self.waiting])
            out.prompts_held = cap < budget
            budget = max(0, min(budget, cap))
        for s in prefilling:
            if budget <= 0:
                break
            n = self._chunk(s, budget)
            if n > 0:
                self.kv.grow(s, s.num_computed + n)
                out.rows.append(ScheduledRow(s, n, 0))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            s = self.waiting[0]
            self.kv.admit(s)
            n = self._chunk(s, budget, reserve=len(self.running))
            if n <= 0:  # no room in the pool now: it waits (its prefix-cache references go back)
                self.kv.free(s)
                break
            self.waiting.popleft()
            s.status = Status.RUNNING
            s.num_cached_tokens = s.num_computed
            if self.on_admit is not None:
                self.on_admit(s)
            self.running.append(s)
            out.admitted.append(s)
            self.kv.grow(s, s.num_computed + n)
            out.rows.append(ScheduledRow(s, n, 0))
            budget -= n
        return out

    def _chunk(self, s: Sequence, budget: int, reserve: int = 0) -> int:
        """Positions of ``s``'s uncomputed tail that fit the budget and the pool (keeping
        ``reserve`` blocks free for the running requests to grow into)."""
        B = self.kv.block_size
        n = min(len(s.token_ids) - s.num_computed, budget)
        room = (len(s.block_table) * B - s.num_computed) + max(0, self.kv.pool.num_free - reserve) * B
        return min(n, room)

    def _preempt(self, s: Sequence, out: SchedulerOutput) -> None:
        self.num_preempted += 1
        self.running.remove(s)
        self.kv.free(s)
        s.status = Status.WAITING
        s.draft_computed = s.head_fed = 0
        s.head_last = None
        self.waiting.appendleft(s)
        out.preempted.append(s)
        out.rows = [r for r in out.rows if r.seq is not s]

    def finish(self, s: Sequence) -> None:
        """``s`` left the engine (finished or aborted): its blocks go back."""
        if s in self.running:
            self.running.remove(s)
        else:
            try:
                self.waiting.remove(s)
            except ValueError:
                pass
        self.kv.free(s)
