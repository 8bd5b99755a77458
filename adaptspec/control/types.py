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

# "draft" runs a draft model (a forward per drafted position); the others look tokens up on
# the host (n-gram prompt lookup, the suffix drafter): the cost model prices them apart
DRAFTERS = ("none", "ngram", "draft", "suffix")
MAX_K = 16
# draft confidences are counted in this many equal bins of [0, 1]; thresholds lie on bin edges
CONF_BINS = 10


@dataclass(slots=True, frozen=True)
class Arm:
    """(drafter, k, min_confidence): propose up to ``k`` candidates with ``drafter``, stopping
    a request's draft at its first token whose draft confidence is below ``min_confidence``
    (0: never stop early); k = 0 means no drafting."""

    drafter: str = "none"
    k: int = 0
    min_confidence: float = 0.0

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter: {self.drafter!r} is not one of {DRAFTERS}")
        if not 0 <= self.k <= MAX_K:
            raise ValueError(f"k: {self.k} is outside 0..{MAX_K}")
        if not 0.0 <= self.min_confidence < 1.0:
            raise ValueError(f"min_confidence: {self.min_confidence} is outside [0, 1)")
        if (self.drafter == "none") != (self.k == 0):
            # normalise: k = 0 is always the 'none' arm, 'none' always has k = 0
            object.__setattr__(self, "drafter", "none")
            object.__setattr__(self, "k", 0)
        if self.k == 0 and self.min_confidence:
            object.__setattr__(self, "min_confidence", 0.0)

    def __str__(self) -> str:
        if self.k == 0:
            return "none"
        return f"{self.drafter}:{self.k}" + (f"@{self.min_confidence:.2f}" if self.min_confidence else "")

    @classmethod
    def parse(cls, text: str) -> "Arm":
        """``none``, ``draft:4`` or ``draft:8@0.30`` (as ``str`` writes it); ValueError otherwise."""
        body, _, conf = text.strip().partition("@")
        drafter, _, k = body.partition(":")
        if drafter != "none" and not k:
            raise ValueError(f"arm: {text!r} is not none, <drafter>:<k> or <drafter>:<k>@<min_confidence>")
        try:
            return cls(drafter, int(k or 0), float(conf) if conf else 0.0)
        except ValueError as exc:
            raise ValueError(f"arm: {text!r}: {exc}") from None


NO_SPEC = Arm("none", 0)


@dataclass(slots=True, frozen=True)
class Load:
    """The load a decision is made under (from the engine's latest step)."""

    batch_size: int = 1  # running requests
    queued: int = 0  # requests waiting for admission
    verify_tokens: int = 0  # tokens in the last batched target pass (0 = unknown)
    context_tokens: int = 0  # KV tokens the last step's requests read (0 = unknown)


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
    # the drafter's confidence in each drafted token, in order (the head's probability, the
    # n-gram match's frequency); None or empty: the drafter reports none
    draft_confidence: list[float] | None = None
    min_confidence: float = 0.0  # the arm's threshold (drafting stopped below it)


@dataclass(slots=True)
class ConfidenceCounts:
    """What drafted tokens' confidences said, per confidence bin (``CONF_BINS`` of [0, 1]).

    ``seen[j, b]``: tokens drafted at position j + 1 with confidence in bin b (drafting at
    threshold 0 only: a threshold hides the confidences below it); ``accepted[b]`` /
    ``rejected[b]``: verified tokens whose fate is known (up to the first rejection)."""

    seen: np.ndarray  # [K, CONF_BINS]
    accepted: np.ndarray  # [CONF_BINS]
    rejected: np.ndarray  # [CONF_BINS]

    @classmethod
    def empty(cls, k: int) -> "ConfidenceCounts":
        return cls(np.zeros((k, CONF_BINS)), np.zeros(CONF_BINS), np.zeros(CONF_BINS))

    def add_request(self, confidence, drafted: int, accepted: int, threshold: float) -> None:
        """One request's part: ``confidence`` of its drafted tokens (at least ``drafted``)."""
        c = np.asarray(confidence[:drafted], dtype=float)
        if c.size == 0:
            return
        b = conf_bin(c)
        if threshold <= 0:
            np.add.at(self.seen, (np.arange(min(b.size, self.seen.shape[0])), b[: self.seen.shape[0]]), 1.0)
        np.add.at(self.accepted, b[: min(accepted, drafted)], 1.0)
        if accepted < drafted:
            self.rejected[b[accepted]] += 1.0  # the first rejection; later tokens' fate is unknown


def conf_bin(c: np.ndarray) -> np.ndarray:
    """Confidences -> bin indices 0..CONF_BINS-1."""
    return np.minimum((np.asarray(c) * CONF_BINS).astype(np.int64), CONF_BINS - 1)


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
    # [k + 1, k + 1] requests that proposed m candidates and kept j (H[m, j]); None: every
    # request proposed all k. A request that proposed m < k and kept all m did not fail at
    # position m + 1 (it was never drafted): the acceptance posteriors censor it there
    drafted_accepted: np.ndarray | None = None
    confidence: ConfidenceCounts | None = None  # None: the drafter reports no confidences

    def __post_init__(self) -> None:
        if self.num_requests < 0:  # read many times per step by every policy: count once
            self.num_requests = int(self.accepted_hist.sum())
        if self.drafted < 0:
            if self.drafted_accepted is not None:
                self.drafted = int(np.dot(np.arange(self.drafted_accepted.shape[0]), self.drafted_accepted.sum(axis=1)))
            else:
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
    context_tokens: int  # KV tokens the step's requests read (prompt chunks' cached ones too, as the engine counts)
    draft_s: float
    verify_s: float
    other_s: float
    wall_s: float
    groups: list[GroupOutcome] = field(default_factory=list)
    queued: int = 0
    # seconds of a prefill pass of its own (the live engine's), part of wall_s and of no
    # other part: every request prefills once whatever the arms, so policies judge arms by
    # the decode part (wall_s - prefill_s) and count prefill only against latency targets.
    # 0 where prefill shares the verification pass (the simulator, and the engine through
    # ``from_step_stats``: num_prefill tokens of verify_tokens)
    prefill_s: float = 0.0
    prefill_chunks: int = 0  # prompts whose tokens (all, or a budget's worth) num_prefill holds

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
        prefill_chunks: int = 0,
    ) -> "StepOutcome":
        """The engine adapter: aggregate per-request outcomes into groups."""
        acc: dict[tuple[str, Arm], list[int]] = {}
        emitted: dict[tuple[str, Arm], int] = {}
        drafted: dict[tuple[str, Arm], list[int]] = {}
        conf: dict[tuple[str, Arm], ConfidenceCounts] = {}
        for r in requests:
            key = (r.request_class, Arm(r.drafter, r.k, r.min_confidence if r.k else 0.0))
            k = key[1].k
            m = min(r.drafted, k) if r.drafted >= 0 else k
            a = min(r.accepted, m)
            acc.setdefault(key, []).append(a)
            emitted[key] = emitted.get(key, 0) + r.emitted
            drafted.setdefault(key, []).append(m)
            if r.draft_confidence and k:
                cc = conf.get(key)
                if cc is None:
                    cc = conf[key] = ConfidenceCounts.empty(k)
                cc.add_request(r.draft_confidence, m, a, key[1].min_confidence)
        groups = []
        for (c, arm), a in acc.items():
            m = drafted[(c, arm)]
            hist = np.bincount(np.asarray(a, dtype=np.int64), minlength=arm.k + 1)
            H = None
            if arm.k and min(m) < arm.k:  # someone proposed fewer than k: say who
                H = np.zeros((arm.k + 1, arm.k + 1))
                np.add.at(H, (np.asarray(m), np.asarray(a)), 1.0)
            groups.append(GroupOutcome(c, arm, hist, emitted[(c, arm)], len(a), int(sum(m)), H, conf.get((c, arm))))
        return cls(batch_size, num_prefill, verify_tokens, context_tokens, draft_s, verify_s,
                   other_s, wall_s, groups, queued, prefill_s, prefill_chunks)

    @classmethod
    def from_step_stats(cls, st) -> "StepOutcome":
        """Adapter for the engine's ``StepStats`` (read by attribute; no engine import).

        The engine's prompt chunks ride in the step's one forward with the verification tokens,
        as the simulator's do, and the outcome says so the simulator's way: ``num_prefill`` the
        prompt tokens, ``prefill_chunks`` the requests they came from, ``verify_tokens`` and
        ``verify_s`` the whole forward (the planner prices chunks apart from the decode tokens
        by them), ``prefill_s`` 0. The engine reports the forward split by tokens
        (``prefill_s``: the prompt's share), which suits a benchmark that leaves the prompt
        out, but a forward's cost is mostly fixed: a step of 24 prompt and 3 decode tokens
        would read as 3 verification tokens for a ninth of a 3-token decode step, and a cost
        model fitted on such steps priced extra verification tokens at up to twice their
        cost, most where prompts arrive often (high load), which the simulator never showed.
        """
        reqs = [RequestOutcome(r.request_id, r.request_class, r.drafter, r.k, r.accepted, r.emitted, r.drafted,
                               getattr(r, "draft_confidence", None), float(getattr(r, "min_confidence", 0.0) or 0.0))
                for r in st.requests]
        prompt = int(getattr(st, "prefill_tokens", 0) or 0)
        return cls.from_requests(
            reqs, batch_size=st.batch_size, num_prefill=prompt, verify_tokens=st.verify_tokens + prompt,
            context_tokens=st.context_tokens, draft_s=st.draft_s,
            verify_s=st.verify_s + float(getattr(st, "prefill_s", 0.0) or 0.0), other_s=st.other_s,
            wall_s=st.wall_s, queued=getattr(st, "backlog", getattr(st, "num_waiting", 0)),
            prefill_chunks=int(getattr(st, "num_prefill", 0) or 0) if prompt else 0)


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
