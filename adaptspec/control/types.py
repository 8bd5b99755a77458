"""What the controller sees and says: arms, load, step outcomes, targets, decision stats.

The live engine and the simulator fill the same dataclasses. The engine reports, per step,
``batch_size, num_prefill, verify_tokens, context_tokens, draft_s, verify_s, other_s,
wall_s`` (and ``prefill_s``: see ``StepOutcome``) and, per request, ``request_id,
request_class, drafter, k, accepted, emitted, drafted``;
``StepOutcome.from_requests`` is the whole adapter. The simulator, which must be fast,
fills ``StepOutcome.groups`` directly with per-(class, arm) histograms of accepted tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

DRAFTERS = ("none", "ngram", "draft")
MAX_K = 16


@dataclass(slots=True, frozen=True)
class Arm:
    """(drafter, k): propose ``k`` candidates with ``drafter``; k = 0 means no drafting."""

    drafter: str = "none"
    k: int = 0

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter: {self.drafter!r} is not one of {DRAFTERS}")
        if not 0 <= self.k <= MAX_K:
            raise ValueError(f"k: {self.k} is outside 0..{MAX_K}")
        if (self.drafter == "none") != (self.k == 0):
            # normalise: k = 0 is always the 'none' arm, 'none' always has k = 0
            object.__setattr__(self, "drafter", "none")
            object.__setattr__(self, "k", 0)

    def __str__(self) -> str:
        return "none" if self.k == 0 else f"{self.drafter}:{self.k}"


NO_SPEC = Arm("none", 0)


@dataclass(slots=True, frozen=True)
class Load:
    """The load a decision is made under (from the engine's latest step)."""

    batch_size: int = 1  # running requests
    queued: int = 0  # requests waiting for admission
    verify_tokens: int = 0  # tokens in the last batched target pass (0 = unknown)
    context_tokens: int = 0  # KV tokens read by the last step's decoding requests (0 = unknown)


@dataclass(slots=True)
class RequestOutcome:
    """One request's part of a step, as the engine reports it."""

    request_id: str
    request_class: str
    drafter: str
    k: int  # candidates asked for (the arm's k)
    accepted: int
    emitted: int  # accepted + 1 unless the request stopped inside the block
    drafted: int = -1  # candidates actually proposed (n-gram lookup often finds fewer); -1: k


@dataclass(slots=True)
class GroupOutcome:
    """All requests of one class that used one arm in one step (the aggregated form)."""

    request_class: str
    arm: Arm
    accepted_hist: np.ndarray  # [k + 1] number of requests that accepted exactly j drafted
    emitted: int  # tokens emitted by these requests in this step
    num_requests: int = -1  # the histogram's total; computed from it when not given
    # candidates these requests proposed: fewer than k per request when n-gram lookup finds no
    # (or a short) match, and then the verification pass carries fewer tokens; -1: k each
    drafted: int = -1

    def __post_init__(self) -> None:
        if self.num_requests < 0:  # read many times per step by every policy: count once
            self.num_requests = int(self.accepted_hist.sum())
        if self.drafted < 0:
            self.drafted = self.arm.k * self.num_requests

    @property
    def accepted(self) -> int:
        return int(np.dot(np.arange(self.accepted_hist.size), self.accepted_hist))


@dataclass(slots=True)
class StepOutcome:
    """One engine step: timings, batch shape and per-(class, arm) acceptance."""

    batch_size: int
    num_prefill: int  # prompt tokens processed in this step
    verify_tokens: int  # all tokens in the one batched target pass (prefill + sum(k + 1))
    context_tokens: int  # KV tokens read by decoding requests
    draft_s: float
    verify_s: float
    other_s: float
    wall_s: float
    groups: list[GroupOutcome] = field(default_factory=list)
    queued: int = 0
    # seconds of a prefill pass of its own (the live engine's), part of wall_s and of no
    # other part: every request prefills once whatever the arms, so policies judge arms by
    # the decode part (wall_s - prefill_s) and count prefill only against latency targets.
    # 0 where prefill shares the verification pass (the simulator: num_prefill tokens)
    prefill_s: float = 0.0

    @classmethod
    def from_requests(
        cls,
        requests: list[RequestOutcome],
        *,
        batch_size: int,
        num_prefill: int,
        verify_tokens: int,
        context_tokens: int,
        draft_s: float,
        verify_s: float,
        other_s: float,
        wall_s: float,
        queued: int = 0,
        prefill_s: float = 0.0,
    ) -> "StepOutcome":
        """The engine adapter: aggregate per-request outcomes into groups."""
        acc: dict[tuple[str, Arm], list[int]] = {}
        emitted: dict[tuple[str, Arm], int] = {}
        drafted: dict[tuple[str, Arm], int] = {}
        for r in requests:
            key = (r.request_class, Arm(r.drafter, r.k))
            k = key[1].k
            acc.setdefault(key, []).append(min(r.accepted, k))
            emitted[key] = emitted.get(key, 0) + r.emitted
            drafted[key] = drafted.get(key, 0) + (min(r.drafted, k) if r.drafted >= 0 else k)
        groups = [
            GroupOutcome(c, arm, np.bincount(np.asarray(a, dtype=np.int64), minlength=arm.k + 1), emitted[(c, arm)],
                         len(a), drafted[(c, arm)])
            for (c, arm), a in acc.items()
        ]
        return cls(batch_size, num_prefill, verify_tokens, context_tokens, draft_s, verify_s,
                   other_s, wall_s, groups, queued, prefill_s)

    @classmethod
    def from_step_stats(cls, st) -> "StepOutcome":
        """Adapter for the engine's ``StepStats`` (read by attribute; no engine import).

        The engine prefills in its own pass, so its ``verify_tokens``/``verify_s`` cover the
        verification pass only and its prefill time is ``prefill_s``, apart from the host
        overhead (``other_s``). (It was counted with the overhead until 2026-12-01: a constant
        part of every step in the planner's eyes, which made verifying more tokens look
        cheaper than it is, most at high load where prefill is half of a step on the CPU.)
        """
        reqs = [RequestOutcome(r.request_id, r.request_class, r.drafter, r.k, r.accepted, r.emitted, r.drafted)
                for r in st.requests]
        return cls.from_requests(
            reqs, batch_size=st.batch_size, num_prefill=0, verify_tokens=st.verify_tokens,
            context_tokens=st.context_tokens, draft_s=st.draft_s, verify_s=st.verify_s,
            other_s=st.other_s, wall_s=st.wall_s, queued=getattr(st, "num_waiting", 0),
            prefill_s=getattr(st, "prefill_s", 0.0))


@dataclass(slots=True, frozen=True)
class ClassTarget:
    """A latency target an operator states for a request class (None: throughput traffic)."""

    request_class: str
    tpot_s: float | None = None
    ttft_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("tpot_s", "ttft_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name}: must be > 0, got {v}")


@dataclass(slots=True)
class DecisionStats:
    """Counts and costs of decisions; shared by logs, metrics and the simulator."""

    decisions: int = 0
    decision_s_total: float = 0.0
    decision_s_max: float = 0.0
    observed_steps: int = 0
    _counts: dict = field(default_factory=dict)  # (class, Arm) -> n, kept cheap per decision

    def observe_decision(self, request_class: str, arm: Arm, seconds: float) -> None:
        self.decisions += 1
        self.decision_s_total += seconds
        if seconds > self.decision_s_max:
            self.decision_s_max = seconds
        key = (request_class, arm)
        self._counts[key] = self._counts.get(key, 0) + 1

    @property
    def arm_counts(self) -> dict[str, dict[str, int]]:
        """class -> arm ("drafter:k" or "none") -> decisions."""
        out: dict[str, dict[str, int]] = {}
        for (c, arm), n in self._counts.items():
            out.setdefault(c, {})[str(arm)] = n
        return out

    @property
    def mean_decision_us(self) -> float:
        return 1e6 * self.decision_s_total / max(self.decisions, 1)
