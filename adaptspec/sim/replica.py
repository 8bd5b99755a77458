"""One simulated replica: continuous batching, chunked prefill, speculative steps.

Each step: admit queued requests while a slot and KV room are free; ask the policy for an
arm per request class among decoding requests (one decision per class per step, the
snapshot the engine would use); sample accepted tokens from the class's acceptance model;
price the step with the cost model; advance every request; report a ``StepOutcome``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from adaptspec.control import Arm, GroupOutcome, Load, Policy, StepOutcome
from adaptspec.sim.acceptance import AcceptanceModel
from adaptspec.sim.costs import ProfileCostModel
from adaptspec.sim.workload import Requests


@dataclass(slots=True)
class ClassTruth:
    """A class's true acceptance per drafter (and its change mid-run, if any)."""

    name: str
    acceptance: dict[str, AcceptanceModel]
    shift_at_s: float | None = None
    shifted: dict[str, AcceptanceModel] | None = None

    def at(self, t: float) -> dict[str, AcceptanceModel]:
        if self.shift_at_s is not None and t >= self.shift_at_s and self.shifted is not None:
            return self.shifted
        return self.acceptance


@dataclass(slots=True)
class Recorder:
    """Everything a run measures, filled by replicas as steps complete."""

    num_requests: int
    num_classes: int
    arms: list[Arm]
    bin_s: float
    num_bins: int
    first_token_s: np.ndarray = field(init=False)
    finish_s: np.ndarray = field(init=False)
    step_end: list[float] = field(default_factory=list)
    step_wall: list[float] = field(default_factory=list)
    step_decoding: list[int] = field(default_factory=list)
    step_emitted: list[int] = field(default_factory=list)
    arm_counts: np.ndarray = field(init=False)  # [C, bins, A] request-steps per arm
    accepted_sum: np.ndarray = field(init=False)  # [C, bins] sum of accepted lengths
    accepted_n: np.ndarray = field(init=False)  # [C, bins] request-steps
    arm_index: dict[Arm, int] = field(init=False)

    def __post_init__(self) -> None:
        self.first_token_s = np.full(self.num_requests, np.nan)
        self.finish_s = np.full(self.num_requests, np.nan)
        self.arm_counts = np.zeros((self.num_classes, self.num_bins, len(self.arms)))
        self.accepted_sum = np.zeros((self.num_classes, self.num_bins))
        self.accepted_n = np.zeros((self.num_classes, self.num_bins))
        self.arm_index = {a: i for i, a in enumerate(self.arms)}

    def bin(self, t: float) -> int:
        return min(int(t / self.bin_s), self.num_bins - 1)


class Replica:
    def __init__(self, cost: ProfileCostModel, policy: Policy, classes: list[ClassTruth], requests: Requests,
                 recorder: Recorder, rng: np.random.Generator, max_k: int) -> None:
        prof = cost.profile
        self.cost, self.policy, self.classes, self.req, self.rec, self.rng = cost, policy, classes, requests, recorder, rng
        self.max_k = max_k
        self.max_tokens = prof.max_batched_tokens
        self.kv_capacity = prof.kv_capacity_tokens
        S = prof.max_num_seqs
        self.active = np.zeros(S, dtype=bool)
        self.rid = np.zeros(S, dtype=np.int64)
        self.cls = np.zeros(S, dtype=np.int64)
        self.remaining = np.zeros(S, dtype=np.int64)
        self.ctx = np.zeros(S, dtype=np.int64)
        self.prefill_left = np.zeros(S, dtype=np.int64)
        self.prefilling: list[int] = []  # slots in admission order
        self.queue: deque[int] = deque()
        self.kv_used = 0
        self.busy_until = np.inf  # idle
        self.last_verify_tokens = 0
        self.last_context = 0

    @property
    def load(self) -> int:
        return int(self.active.sum()) + len(self.queue)

    def enqueue(self, rid: int, now: float) -> None:
        self.queue.append(rid)
        if self.busy_until == np.inf:
            self.busy_until = now

    def _admit(self) -> None:
        free = np.flatnonzero(~self.active)
        i = 0
        while self.queue and i < free.size:
            r = self.queue[0]
            need = int(self.req.prompt_tokens[r] + self.req.output_tokens[r])
            if self.kv_used + need > self.kv_capacity and self.kv_used > 0:
                break
            self.queue.popleft()
            s = free[i]
            i += 1
            self.active[s] = True
            self.rid[s], self.cls[s] = r, self.req.class_idx[r]
            self.remaining[s] = self.req.output_tokens[r]
            self.prefill_left[s] = self.req.prompt_tokens[r]
            self.ctx[s] = 0
            self.kv_used += need
            self.prefilling.append(int(s))

    def step(self, now: float) -> None:
        """Run one step starting at ``now``; sets ``busy_until`` to its end (inf: idle)."""
        self._admit()
        if not self.prefilling and not self.active.any():
            self.busy_until = np.inf
            return
        dec = np.flatnonzero(self.active & (self.prefill_left == 0))
        dec = dec[np.argsort(self.cls[dec], kind="stable")]  # grouped by class
        counts = np.bincount(self.cls[dec], minlength=len(self.classes))
        n_active = int(self.active.sum())
        load = Load(n_active, len(self.queue), self.last_verify_tokens, self.last_context)
        accepted = np.zeros(dec.size, dtype=np.int64)
        groups = []  # (class, arm, start, stop)
        draft_batch = np.zeros(self.max_k)
        ngram = 0
        decode_tokens = 0
        start = 0
        deciding = np.flatnonzero(counts).tolist()
        arms = self.policy.choose_many([self.classes[c].name for c in deciding], load)
        for c, arm in zip(deciding, arms):
            n = int(counts[c])
            truth = self.classes[c]
            if arm.k > 0:
                model = truth.at(now).get(arm.drafter)
                if model is not None:
                    accepted[start: start + n] = model.sample(arm.k, n, self.rng)
                if arm.drafter == "draft":
                    draft_batch[: arm.k] += n
                else:
                    ngram += n
            decode_tokens += n * (arm.k + 1)
            groups.append((int(c), arm, start, start + n))
            start += n
        # chunked prefill within the step's token budget, in admission order
        budget = max(self.max_tokens - decode_tokens, 0)
        prefill_tokens = 0
        chunks = []
        for s in self.prefilling:
            if budget <= 0:
                break
            take = min(int(self.prefill_left[s]), budget)
            chunks.append((s, take))
            budget -= take
            prefill_tokens += take
        context = int(self.ctx[dec].sum())
        n_dec = dec.size
        mean_ctx = context / n_dec if n_dec else 0.0
        verify_tokens = prefill_tokens + decode_tokens
        t = self.cost.step(verify_tokens, context, draft_batch, ngram, mean_ctx)
        end = now + t.wall_s
        rec = self.rec
        b = rec.bin(end)
        emitted = np.minimum(accepted + 1, self.remaining[dec])
        self.remaining[dec] -= emitted
        self.ctx[dec] += emitted
        emitted_total = int(emitted.sum())
        outcome_groups = []
        for c, arm, lo, hi in groups:
            acc = accepted[lo:hi]
            n = hi - lo
            rec.arm_counts[c, b, rec.arm_index.get(arm, 0)] += n
            rec.accepted_n[c, b] += n
            hist = np.bincount(acc, minlength=arm.k + 1)
            a_sum = int(acc.sum())
            rec.accepted_sum[c, b] += a_sum + n
            outcome_groups.append(GroupOutcome(self.classes[c].name, arm, hist, int(emitted[lo:hi].sum()), n))
        done = dec[self.remaining[dec] <= 0]
        if done.size:
            self._finish(done, end)
        for s, take in chunks:
            self.prefill_left[s] -= take
            self.ctx[s] += take
            if self.prefill_left[s] == 0:
                self.prefilling.remove(s)
                r = self.rid[s]
                rec.first_token_s[r] = end  # the prefill pass samples the first token
                self.remaining[s] -= 1
                self.ctx[s] += 1
                emitted_total += 1
                if self.remaining[s] <= 0:
                    self._finish(np.array([s]), end)
        rec.step_end.append(end)
        rec.step_wall.append(t.wall_s)
        rec.step_decoding.append(n_dec)
        rec.step_emitted.append(emitted_total)
        self.last_verify_tokens, self.last_context = verify_tokens, context
        self.policy.observe(StepOutcome(n_active, prefill_tokens, verify_tokens, context, t.draft_s, t.verify_s,
                                        t.other_s, t.wall_s, outcome_groups, len(self.queue)))
        self.busy_until = end

    def _finish(self, slots: np.ndarray, end: float) -> None:
        r = self.rid[slots]
        self.rec.finish_s[r] = end
        self.active[slots] = False
        self.kv_used -= int((self.req.prompt_tokens[r] + self.req.output_tokens[r]).sum())
