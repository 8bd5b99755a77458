"""Model-free UCB over arms per (class, load bucket): discounted or sliding-window."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from adaptspec.control.base import Clock, Policy, PolicyConfig
from adaptspec.control.types import Arm, Load, StepOutcome

# load buckets by running batch size: 1, 2-3, 4-7, 8-15, ... (log2)
def load_bucket(batch_size: int) -> int:
    return int(max(batch_size, 1)).bit_length() - 1


@dataclass(slots=True)
class UCBConfig:
    mode: str = "discounted"  # or "window"
    discount: float = 0.998  # per update of a (class, bucket)
    window: int = 300  # updates kept per (class, bucket) in window mode
    exploration: float = 0.05  # c in mean + c * sqrt(log(n) / n_a)

    def __post_init__(self) -> None:
        if self.mode not in ("discounted", "window"):
            raise ValueError(f"mode: {self.mode!r} must be 'discounted' or 'window'")


@dataclass(slots=True)
class _Cell:
    n: np.ndarray
    s: np.ndarray
    history: deque = field(default_factory=deque)


class DiscountedUCB(Policy):
    """UCB over the arm table per (class, load bucket).

    Reward of a class's arm in a step = the step's emitted tokens per request per second of
    step time (the batch's goodput: an arm that slows the step for everyone pays for it),
    divided by a slowly decaying running maximum per class so rewards lie in [0, 1]. A TPOT class earns 0 in a step whose per-token latency
    (step seconds / emitted per request) missed its target, which steers it to arms that
    meet the target; throughput classes do not see other classes' targets.
    """

    name = "ucb"

    def __init__(self, config: PolicyConfig | None = None, ucb: UCBConfig | None = None, *,
                 clock: Clock = time.perf_counter) -> None:
        super().__init__(config, clock=clock)
        self.ucb = ucb or UCBConfig()
        if self.ucb.mode == "window":
            self.name = "ucb-window"
        self.cells: dict[tuple[str, int], _Cell] = {}
        self.scale: dict[str, float] = {}
        self._pending: dict[str, int] = {}  # class -> bucket of its last decision

    def _cell(self, key: tuple[str, int]) -> _Cell:
        cell = self.cells.get(key)
        if cell is None:
            A = len(self.table.arms)
            cell = self.cells[key] = _Cell(np.zeros(A), np.zeros(A))
        return cell

    def _choose(self, request_class: str, load: Load) -> Arm:
        bucket = load_bucket(load.batch_size)
        self._pending[request_class] = bucket
        cell = self._cell((request_class, bucket))
        untried = np.flatnonzero(cell.n < 1e-9)
        if untried.size:  # in random order, so classes sharing a step do not move in lockstep
            return self.table.arms[int(self.rng.choice(untried))]
        total = cell.n.sum()
        index = cell.s / cell.n + self.ucb.exploration * np.sqrt(np.log(max(total, 2.0)) / cell.n)
        best = np.flatnonzero(index >= index.max() - 1e-12)
        return self.table.arms[int(best[0] if best.size == 1 else self.rng.choice(best))]

    def _observe(self, outcome: StepOutcome) -> None:
        decode_s = outcome.wall_s - outcome.prefill_s  # the part the arms change (see StepOutcome)
        if decode_s <= 0:
            return
        n_all = sum(g.num_requests for g in outcome.groups)
        if n_all == 0:
            return
        # the batch's goodput: a class's arm is judged by what the whole step emitted
        step_rate = sum(g.emitted for g in outcome.groups) / (n_all * decode_s)
        for g in outcome.groups:
            c = g.request_class
            n = g.num_requests
            if n == 0:
                continue
            per_request = g.emitted / n
            rate = step_rate
            tgt = self.targets.get(c)
            if tgt is not None and tgt.tpot_s is not None and outcome.wall_s / per_request > tgt.tpot_s:
                rate = 0.0
            scale = max(self.scale.get(c, 0.0) * 0.9995, rate, 1e-12)
            self.scale[c] = scale
            bucket = self._pending.get(c, 0)
            self._update(self._cell((c, bucket)), self.table.index(g.arm), rate / scale)

    def _update(self, cell: _Cell, arm: int, reward: float) -> None:
        if self.ucb.mode == "discounted":
            g = self.ucb.discount
            cell.n *= g
            cell.s *= g
            cell.n[arm] += 1.0
            cell.s[arm] += reward
            return
        cell.history.append((arm, reward))
        cell.n[arm] += 1.0
        cell.s[arm] += reward
        if len(cell.history) > self.ucb.window:
            old_arm, old_reward = cell.history.popleft()
            cell.n[old_arm] -= 1.0
            cell.s[old_arm] -= old_reward

    def describe_targets(self) -> str:
        return ("a TPOT class earns reward 0 in steps that missed its target; throughput classes "
                "ignore other classes' targets")
