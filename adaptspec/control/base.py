"""The one policy interface: ``choose(request_class, load) -> Arm`` and ``observe(outcome)``."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from adaptspec.control.planner import ArmTable, BatchPicture, check_thresholds
from adaptspec.control.types import DRAFTERS, MAX_K, Arm, ClassTarget, DecisionStats, Load, StepOutcome

Clock = Callable[[], float]


@dataclass(slots=True)
class PolicyConfig:
    """What every policy is built from."""

    drafters: tuple[str, ...] = ("ngram", "draft")  # drafters the deployment has
    max_k: int = 8
    targets: tuple[ClassTarget, ...] = ()
    seed: int = 0
    # draft-confidence thresholds the policy may set (per-token draft stopping; bin edges of
    # CONF_BINS, e.g. (0.3, 0.5, 0.7)); empty: none, every draft runs its full k
    thresholds: tuple[float, ...] = ()
    # the replica's limits, when known: running requests, and tokens a step may carry
    max_num_seqs: int | None = None
    max_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        for d in self.drafters:
            if d not in DRAFTERS:
                raise ValueError(f"drafters: {d!r} is not one of {DRAFTERS}")
        if not 1 <= self.max_k <= MAX_K:
            raise ValueError(f"max_k: {self.max_k} is outside 1..{MAX_K}")
        self.thresholds = check_thresholds(tuple(self.thresholds))

    def target_map(self) -> dict[str, ClassTarget]:
        return {t.request_class: t for t in self.targets}


def draft_positions(step: StepOutcome, max_k: int) -> tuple[np.ndarray, int]:
    """[max_k] requests drafting with the draft model at each position, and requests drafting
    by host lookup (n-gram, suffix)."""
    batch = np.zeros(max_k)
    ngram = 0
    for g in step.groups:
        if g.arm.drafter == "draft":
            k = min(g.arm.k, max_k)
            if g.drafted_accepted is None:
                batch[:k] += g.num_requests
            else:  # a request that proposed m ran m forwards (m + 1 when a threshold stopped it)
                per_m = g.drafted_accepted.sum(axis=1)[: k + 1]
                runs = np.minimum(np.arange(per_m.size) + (1 if g.arm.min_confidence else 0), k)
                batch[:k] += (per_m[:, None] * (np.arange(k)[None, :] < runs[:, None])).sum(axis=0)
        elif g.arm.k:  # a host lookup (n-gram, suffix)
            ngram += g.num_requests
    return batch, ngram


class Policy:
    """Base class: timing of decisions, the batch picture, decision stats.

    Subclasses implement ``_choose`` and ``_observe``. The clock is injected (defaults to
    ``time.perf_counter``) and used only to measure decision cost.
    """

    name = "policy"

    def __init__(self, config: PolicyConfig | None = None, *, clock: Clock = time.perf_counter) -> None:
        self.config = config or PolicyConfig()
        self.table = ArmTable.build(self.config.drafters, self.config.max_k, self.config.thresholds)
        self.targets = self.config.target_map()
        self.picture = BatchPicture()
        self.stats = DecisionStats()
        self.rng = np.random.default_rng(self.config.seed)
        self._clock = clock

    def choose(self, request_class: str, load: Load) -> Arm:
        t0 = self._clock()
        arm = self._choose(request_class, load)
        self.stats.observe_decision(request_class, arm, self._clock() - t0)
        return arm

    def choose_many(self, classes: list[str], load: Load) -> list[Arm]:
        """One arm per class for the same load: a step's (or a snapshot's) decisions at once.

        The same arms as ``choose`` for each class in turn; a policy that vectorises its
        decision (``_choose_many``) makes them in one pass. Each decision's recorded cost is
        its share of the pass."""
        if len(classes) <= 1:
            return [self.choose(c, load) for c in classes]
        t0 = self._clock()
        arms = self._choose_many(classes, load)
        share = (self._clock() - t0) / max(len(classes), 1)
        for c, arm in zip(classes, arms):
            self.stats.observe_decision(c, arm, share)
        return arms

    uses_picture = True  # fixed policies do not read the batch picture: they skip keeping it

    def observe(self, outcome: StepOutcome) -> None:
        if self.uses_picture:
            self.picture.observe(outcome)
        self._observe(outcome)
        self.stats.observed_steps += 1

    def _choose(self, request_class: str, load: Load) -> Arm:  # pragma: no cover - abstract
        raise NotImplementedError

    def _choose_many(self, classes: list[str], load: Load) -> list[Arm]:
        return [self._choose(c, load) for c in classes]

    def _observe(self, outcome: StepOutcome) -> None:
        pass

    def describe_targets(self) -> str:
        """How this policy treats latency targets (for reports)."""
        return "ignores latency targets"
