"""Drafter faults never cost a request: a drafter that raises (or is too slow) means k = 0.

``GuardedProposer`` wraps an engine proposer: an exception in ``propose`` returns empty
drafts for that call (the verifier then emits the target's own token: plain decoding,
still exact), and opens a short cool-down during which the drafter is skipped. A call that
takes longer than ``timeout_s`` opens the cool-down too (a running call cannot be
preempted, but the next steps stop waiting on it). ``FaultyProposer`` injects failures.
"""
from __future__ import annotations

import logging
import time

from adaptspec.engine.proposers import Draft, Proposer

log = logging.getLogger(__name__)


class GuardedProposer(Proposer):
    def __init__(self, inner: Proposer, *, timeout_s: float = 5.0, cooldown_s: float = 1.0):
        self.inner = inner
        self.name = inner.name
        self.timeout_s, self.cooldown_s = timeout_s, cooldown_s
        self.faults = 0
        self.skipped_until = 0.0

    @property
    def wants_features(self) -> bool:  # type: ignore[override]
        return self.inner.wants_features

    def propose(self, seqs, ks) -> list[Draft]:
        now = time.perf_counter()
        if now < self.skipped_until:
            return [Draft([]) for _ in seqs]
        try:
            drafts = self.inner.propose(seqs, ks)
        except Exception as exc:  # any drafter error: k = 0 for these requests this step
            self._fault(f"raised {type(exc).__name__}: {exc}")
            return [Draft([]) for _ in seqs]
        if time.perf_counter() - now > self.timeout_s:
            self._fault(f"took {time.perf_counter() - now:.2f}s (> {self.timeout_s}s)")
        if len(drafts) != len(seqs):
            self._fault(f"returned {len(drafts)} drafts for {len(seqs)} requests")
            return [Draft([]) for _ in seqs]
        return drafts

    def on_verified(self, seq, num_tokens_before, num_accepted, hidden=None) -> None:
        try:
            self.inner.on_verified(seq, num_tokens_before, num_accepted, hidden)
        except Exception as exc:
            self._fault(f"on_verified raised {type(exc).__name__}: {exc}")

    def observe(self, seqs, starts, counts, features) -> None:
        # a head that misses features stops drafting for those sequences (it checks
        # positions), so a failure here costs drafts, never a request
        try:
            self.inner.observe(seqs, starts, counts, features)
        except Exception as exc:
            self._fault(f"observe raised {type(exc).__name__}: {exc}")

    def on_admit(self, seq) -> None:
        try:
            self.inner.on_admit(seq)
        except Exception as exc:
            self._fault(f"on_admit raised {type(exc).__name__}: {exc}")

    def release(self, seq) -> None:
        try:
            self.inner.release(seq)
        except Exception as exc:
            self._fault(f"release raised {type(exc).__name__}: {exc}")

    def _fault(self, what: str) -> None:
        self.faults += 1
        self.skipped_until = time.perf_counter() + self.cooldown_s
        log.warning("drafter %s %s; k = 0 for %.1fs", self.name, what, self.cooldown_s)


class FaultyProposer(Proposer):
    """Raises on every ``every``-th ``propose`` call after ``after_calls`` good ones."""

    def __init__(self, inner: Proposer, after_calls: int = 0, every: int = 1):
        self.inner, self.name = inner, inner.name
        self.after_calls, self.every = after_calls, every
        self.calls = 0

    @property
    def wants_features(self) -> bool:  # type: ignore[override]
        return self.inner.wants_features

    def propose(self, seqs, ks) -> list[Draft]:
        self.calls += 1
        n = self.calls - self.after_calls
        if n > 0 and (n - 1) % self.every == 0:
            raise RuntimeError(f"injected fault in drafter {self.name!r} (call {self.calls})")
        return self.inner.propose(seqs, ks)

    def on_verified(self, seq, num_tokens_before, num_accepted, hidden=None) -> None:
        self.inner.on_verified(seq, num_tokens_before, num_accepted, hidden)

    def observe(self, seqs, starts, counts, features) -> None:
        self.inner.observe(seqs, starts, counts, features)

    def on_admit(self, seq) -> None:
        self.inner.on_admit(seq)

    def release(self, seq) -> None:
        self.inner.release(seq)


def guard_proposers(engine, *, inject=None, timeout_s: float = 5.0, cooldown_s: float = 1.0) -> list[GuardedProposer]:
    """Wrap every proposer of ``engine`` in place; ``inject``: a ``FaultInjection`` config."""
    guards = []

    def wrap(name, prop):
        if inject is not None and inject.drafter == name:
            prop = FaultyProposer(prop, inject.after_calls, inject.every)
        guard = GuardedProposer(prop, timeout_s=timeout_s, cooldown_s=cooldown_s)
        guards.append(guard)
        return guard

    engine.wrap_proposers(wrap)
    return guards
