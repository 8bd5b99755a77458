"""Baselines: static, vLLM-style batch-size schedule, SGLang-style EMA, transformers +2/-1.

None of them reads latency targets: the operator's choice of k (static, schedule) is how a
target is met, and the adaptive ones follow acceptance only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from adaptspec.control.base import Clock, Policy, PolicyConfig
from adaptspec.control.types import NO_SPEC, Arm, Load, StepOutcome


class StaticPolicy(Policy):
    """Always the same arm."""

    name = "static"
    uses_picture = False

    def __init__(self, arm: Arm, config: PolicyConfig | None = None, *, clock: Clock = time.perf_counter) -> None:
        super().__init__(config, clock=clock)
        self.arm = arm
        self.name = f"static-{arm}"

    def _choose(self, request_class: str, load: Load) -> Arm:
        return self.arm


@dataclass(slots=True, frozen=True)
class ScheduleRange:
    start: int  # batch size, inclusive
    end: int  # batch size, inclusive
    k: int


class BatchSchedulePolicy(Policy):
    """vLLM-style: k from a schedule of ``[start, end, k]`` batch-size ranges (offline profiled)."""

    name = "vllm-schedule"

    def __init__(self, drafter: str, schedule: list[ScheduleRange], config: PolicyConfig | None = None,
                 *, clock: Clock = time.perf_counter) -> None:
        super().__init__(config, clock=clock)
        for i, r in enumerate(schedule):
            if r.start > r.end or r.k < 0:
                raise ValueError(f"schedule[{i}]: need start <= end and k >= 0, got {r}")
        self.drafter = drafter
        self.schedule = sorted(schedule, key=lambda r: r.start)

    def _choose(self, request_class: str, load: Load) -> Arm:
        b = load.batch_size
        for r in self.schedule:
            if r.start <= b <= r.end:
                return Arm(self.drafter, r.k)
        return NO_SPEC  # outside every range: no speculation


class EmaPolicy(Policy):
    """SGLang-style: an EMA of the acceptance rate per class moves k with hysteresis.

    k goes up by one when the EMA of accepted/drafted exceeds ``up`` and down by one when
    it falls below ``down``; between the two thresholds k holds (the hysteresis band).
    Changes are at most one per ``cooldown`` observed steps of the class. "Drafted" is what
    the drafter proposed: n-gram lookup proposes fewer than k (none without a match), and a
    step whose group proposed nothing says nothing about acceptance.
    """

    name = "ema"

    def __init__(self, drafter: str, config: PolicyConfig | None = None, *, start_k: int = 4,
                 alpha: float = 0.1, up: float = 0.8, down: float = 0.5, cooldown: int = 10,
                 clock: Clock = time.perf_counter) -> None:
        super().__init__(config, clock=clock)
        if not 0 < down < up < 1:
            raise ValueError(f"thresholds: need 0 < down < up < 1, got down={down}, up={up}")
        self.drafter, self.start_k, self.alpha = drafter, start_k, alpha
        self.up, self.down, self.cooldown = up, down, cooldown
        self.k: dict[str, int] = {}
        self.ema: dict[str, float] = {}
        self.since: dict[str, int] = {}

    def _choose(self, request_class: str, load: Load) -> Arm:
        return Arm(self.drafter, self.k.setdefault(request_class, self.start_k))

    def _observe(self, outcome: StepOutcome) -> None:
        for g in outcome.groups:
            if g.arm.k == 0 or g.arm.drafter != self.drafter:
                continue
            if g.drafted <= 0:  # nothing proposed (n-gram without a match): no evidence either way
                continue
            c = g.request_class
            rate = g.accepted / g.drafted
            e = self.ema.get(c, rate)
            e += self.alpha * (rate - e)
            self.ema[c] = e
            self.since[c] = self.since.get(c, 0) + 1
            if self.since[c] < self.cooldown:
                continue
            k = self.k.get(c, self.start_k)
            if e > self.up and k < self.config.max_k:
                self.k[c], self.since[c] = k + 1, 0
            elif e < self.down and k > 1:
                self.k[c], self.since[c] = k - 1, 0


class HeuristicPolicy(Policy):
    """transformers-style: k += 2 when all drafted were accepted, else k -= 1 (k >= 1).

    Kept per class; a step's group of requests applies the rule once, by majority (all
    accepted by at least half of the class's requests means +2). "All" is all that was
    proposed: a group whose requests proposed the full k each counts those that accepted k;
    one request that proposed fewer (n-gram lookup with a short match) counts as all accepted
    when it kept every one; a group of several that proposed fewer than k x n does not say
    which request proposed what, so it applies no rule; nor does a group that proposed nothing.
    """

    name = "heuristic"

    def __init__(self, drafter: str, config: PolicyConfig | None = None, *, start_k: int = 5,
                 clock: Clock = time.perf_counter) -> None:
        super().__init__(config, clock=clock)
        self.drafter, self.start_k = drafter, start_k
        self.k: dict[str, int] = {}

    def _choose(self, request_class: str, load: Load) -> Arm:
        return Arm(self.drafter, self.k.setdefault(request_class, self.start_k))

    def _observe(self, outcome: StepOutcome) -> None:
        for g in outcome.groups:
            if g.arm.k == 0 or g.arm.drafter != self.drafter:
                continue
            if g.drafted <= 0:
                continue
            if g.drafted >= g.arm.k * g.num_requests:
                all_accepted = int(g.accepted_hist[-1])
            elif g.num_requests == 1:
                all_accepted = int(g.accepted == g.drafted)
            else:
                continue
            k = self.k.get(g.request_class, self.start_k)
            k = k + 2 if 2 * all_accepted >= g.num_requests else k - 1
            self.k[g.request_class] = min(max(k, 1), self.config.max_k)


class PerClassStaticPolicy(Policy):
    """A fixed arm per class (the fair static reference when classes differ); classes not
    named take ``default``."""

    name = "static-per-class"
    uses_picture = False

    def __init__(self, arms: dict[str, Arm], config: PolicyConfig | None = None, *, default: Arm = NO_SPEC,
                 clock: Clock = time.perf_counter) -> None:
        super().__init__(config, clock=clock)
        self.arms, self.default = dict(arms), default
        self.name = "static-" + ",".join(f"{c}={a}" for c, a in self.arms.items())

    def _choose(self, request_class: str, load: Load) -> Arm:
        return self.arms.get(request_class, self.default)


class AdaptiveVerificationPolicy(Policy):
    """vLLM's adaptive verification (PR #47808, ``enable_adaptive_verification``).

    Every request drafts ``k`` tokens (``max_k`` unless given) with ``drafter``. Each step ranks every drafted
    token across the batch by its estimated chance of acceptance (the product of the draft's
    confidences up to it: a token is kept only if every one before it is) and verifies the
    best ones, as many as maximise expected tokens per second of step by a cost table
    profiled at start-up (``verify_s(tokens, context)``: the step's verification seconds).
    It reads no latency target. The simulator calls ``select`` with the step's confidences.
    """

    name = "vllm-adaptive"
    selects_tokens = True

    def __init__(self, drafter: str, verify_s, config: PolicyConfig | None = None, *, k: int | None = None,
                 clock: Clock = time.perf_counter) -> None:
        super().__init__(config, clock=clock)
        self.drafter, self.verify_s = drafter, verify_s
        self.k = self.config.max_k if k is None else k
        if not 1 <= self.k <= self.config.max_k:
            raise ValueError(f"k: {self.k} is outside 1..max_k={self.config.max_k}")

    def _choose(self, request_class: str, load: Load) -> Arm:
        return Arm(self.drafter, self.k)

    def select(self, confidence: np.ndarray, base_tokens: int, context_tokens: float, fixed_s: float) -> np.ndarray:
        """confidence: [n, k] of the drafted tokens; base_tokens: the tokens the step verifies
        anyway (one per request, plus prompt chunks); fixed_s: the step's other seconds
        (drafting, overhead). Returns [n] how many drafted tokens of each request to verify."""
        n, k = confidence.shape
        if n == 0 or k == 0:
            return np.zeros(n, dtype=np.int64)
        p = np.cumprod(confidence, axis=1)  # chance that tokens 1..j are all accepted
        flat = p.ravel()
        order = np.argsort(-flat, kind="stable")
        gain = np.concatenate([[0.0], np.cumsum(flat[order])])  # expected extra tokens verifying the top t
        t = np.arange(gain.size)
        rate = (n + gain) / (self.verify_s(base_tokens + t, context_tokens) + fixed_s)
        top = int(np.argmax(rate))
        # the chosen tokens form a prefix of each request's draft (p falls along a draft)
        chosen = np.zeros(n * k, dtype=bool)
        chosen[order[:top]] = True
        return chosen.reshape(n, k).cumprod(axis=1).sum(axis=1)
