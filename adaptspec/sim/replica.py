"""One simulated replica: continuous batching, chunked prefill, speculative steps.

Each step: admit queued requests while a slot and KV room are free; ask the policy for an
arm per request class among decoding requests (one decision per class per step, the
snapshot the engine would use); sample accepted tokens from the class's acceptance model
(with draft confidences where the scenario gives them: an arm's ``min_confidence`` stops a
request's draft at its first token below it; a recording from the live engine gives the
candidates proposed as well, fewer than ``k`` when n-gram lookup runs out of match); ask
for no more candidates than a request has tokens left, as the engine does; fit the step into its token budget (every
token counts: decode, verification and prompt chunks, decode and verification first, as
vLLM schedules running requests first); price the step with the cost model; advance every
request; report a ``StepOutcome``.
"""
from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from adaptspec.control import Arm, GroupOutcome, Load, Policy, StepOutcome
from adaptspec.control.admission import SloAdmission
from adaptspec.control.pacing import PrefillPacer
from adaptspec.control.types import CONF_BINS, ConfidenceCounts, conf_bin
from adaptspec.sim.acceptance import AcceptanceModel, ConfidenceAcceptance
from adaptspec.sim.acceptance_replay import RecordedAcceptance
from adaptspec.control.costs import ProfileCostModel
from adaptspec.sim.workload import Requests


@dataclass(slots=True)
class ClassTruth:
    """A class's true acceptance per drafter (and its change mid-run, if any)."""

    name: str
    acceptance: dict[str, AcceptanceModel | ConfidenceAcceptance]
    shift_at_s: float | None = None
    shifted: dict[str, AcceptanceModel | ConfidenceAcceptance] | None = None

    def at(self, t: float) -> dict[str, AcceptanceModel | ConfidenceAcceptance]:
        if self.shift_at_s is not None and t >= self.shift_at_s and self.shifted is not None:
            return self.shifted
        return self.acceptance


def arm_key(arm: Arm) -> str:
    """The engine's spelling of an arm ("drafter:k", "none:0"): a live row's arm names."""
    return f"{arm.drafter}:{arm.k}" if arm.k > 0 else "none:0"


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
    refused: np.ndarray = field(init=False)  # [R] bool: refused at arrival (SLO-aware admission)
    step_end: list[float] = field(default_factory=list)
    step_wall: list[float] = field(default_factory=list)
    step_decoding: list[int] = field(default_factory=list)
    step_emitted: list[int] = field(default_factory=list)
    # a list: every step's shape is appended (``sim.step_shapes``; fidelity runs keep them)
    step_shapes: list | None = None
    # {request id: {arm ("drafter:k", "none:0"): request-steps}}: what a live request's row
    # carries (fidelity runs compare them); None: not kept
    request_arms: dict | None = None
    arm_counts: np.ndarray = field(init=False)  # [C, bins, A] request-steps per arm
    accepted_sum: np.ndarray = field(init=False)  # [C, bins] sum of accepted lengths
    accepted_n: np.ndarray = field(init=False)  # [C, bins] request-steps
    arm_index: dict[Arm, int] = field(init=False)

    def __post_init__(self) -> None:
        self.first_token_s = np.full(self.num_requests, np.nan)
        self.finish_s = np.full(self.num_requests, np.nan)
        self.refused = np.zeros(self.num_requests, dtype=bool)
        self.arms = list(self.arms)
        self.arm_counts = np.zeros((self.num_classes, self.num_bins, len(self.arms)))
        self.accepted_sum = np.zeros((self.num_classes, self.num_bins))
        self.accepted_n = np.zeros((self.num_classes, self.num_bins))
        self.arm_index = {a: i for i, a in enumerate(self.arms)}

    def bin(self, t: float) -> int:
        return min(int(t / self.bin_s), self.num_bins - 1)

    def arm_slot(self, arm: Arm) -> int:
        """The column of ``arm`` (an arm outside the policy's table gets a column of its own,
        never counted as another arm)."""
        i = self.arm_index.get(arm)
        if i is None:
            i = self.arm_index[arm] = len(self.arms)
            self.arms.append(arm)
            self.arm_counts = np.concatenate([self.arm_counts, np.zeros(self.arm_counts.shape[:2] + (1,))], axis=2)
        return i


class Replica:
    def __init__(self, cost: ProfileCostModel, policy: Policy, classes: list[ClassTruth], requests: Requests,
                 recorder: Recorder, rng: np.random.Generator, max_k: int, *, drafters: tuple[str, ...] = ("ngram", "draft"),
                 admission: SloAdmission | None = None, host_gap: tuple[float, float] = (0.0, 0.0),
                 pacer: PrefillPacer | None = None) -> None:
        prof = cost.profile
        self.cost, self.policy, self.classes, self.req, self.rec, self.rng = cost, policy, classes, requests, recorder, rng
        self.max_k = max_k
        self.drafters = tuple(drafters)
        self.admission = admission
        self.pacer = pacer  # TPOT-paced prefill (None: prompt chunks fill the step's whole budget)
        # seconds the host spends between two engine steps while work is left (the serving
        # loop's bookkeeping, the controller's reports, tokenizing new requests): a + b per
        # request in the step; not part of the step, so not reported to the policy
        self.host_gap = (float(host_gap[0]), float(host_gap[1]))
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
        self.queued_tokens = 0  # prompt tokens of the queue
        self.prefill_tokens_left = 0  # prompt tokens of admitted requests not yet prefilled
        self.n_active = 0
        self.kv_used = 0
        self.busy_until = np.inf  # idle
        self.last_verify_tokens = 0
        self.last_context = 0
        self.last_starved = 0  # prefilling requests the last step gave no prompt chunk
        self.steps = 0
        self._names = [c.name for c in classes]

    @property
    def load(self) -> int:
        return self.n_active + len(self.queue)

    def backlog_tokens(self) -> int:
        """Prompt tokens waiting: the queue's and the unfinished prefills'."""
        return self.queued_tokens + self.prefill_tokens_left

    def enqueue(self, rid: int, now: float) -> None:
        if self.admission is not None:
            prompt = int(self.req.prompt_tokens[rid])
            if not self.admission.admit(self._names[self.req.class_idx[rid]], prompt, self.backlog_tokens()):
                self.rec.refused[rid] = True
                return
        self.queue.append(rid)
        self.queued_tokens += int(self.req.prompt_tokens[rid])
        if self.busy_until == np.inf:
            self.busy_until = now

    def clone(self, policy: Policy, recorder: Recorder, rng: np.random.Generator) -> "Replica":
        """A copy of this replica's state that runs ``policy`` into ``recorder`` (the
        lookahead oracle's rollouts)."""
        other = copy.copy(self)
        for name in ("active", "rid", "cls", "remaining", "ctx", "prefill_left"):
            setattr(other, name, getattr(self, name).copy())
        other.prefilling = list(self.prefilling)
        other.queue = deque(self.queue)
        other.policy, other.rec, other.rng = policy, recorder, rng
        other.admission = copy.deepcopy(self.admission)
        other.pacer = copy.deepcopy(self.pacer)
        return other

    def _admit(self) -> None:
        free = np.flatnonzero(~self.active)
        i = 0
        while self.queue and i < free.size:
            r = self.queue[0]
            need = int(self.req.prompt_tokens[r] + self.req.output_tokens[r])
            if self.kv_used + need > self.kv_capacity and self.kv_used > 0:
                break
            self.queue.popleft()
            self.queued_tokens -= int(self.req.prompt_tokens[r])
            s = free[i]
            i += 1
            self.active[s] = True
            self.rid[s], self.cls[s] = r, self.req.class_idx[r]
            self.remaining[s] = self.req.output_tokens[r]
            self.prefill_left[s] = self.req.prompt_tokens[r]
            # what a prefix cache served is context from the first pass on, as num_computed live
            self.ctx[s] = 0 if self.req.cached_tokens is None else int(self.req.cached_tokens[r])
            self.kv_used += need
            self.prefilling.append(int(s))
            self.n_active += 1
            self.prefill_tokens_left += int(self.req.prompt_tokens[r])

    def _prompts(self, slots: np.ndarray) -> np.ndarray | None:
        """[n] the prompt (index in its class's prompt set) of the requests in ``slots``; None
        when the requests carry none (a recorded acceptance then replays the class's)."""
        p = self.req.prompt_idx
        return None if p is None else p[self.rid[slots]]

    def _check(self, arm: Arm) -> None:
        if arm.k > self.max_k:
            raise ValueError(f"policy {self.policy.name!r} chose {arm}: k above max_k={self.max_k}")
        if arm.k and arm.drafter not in self.drafters:
            raise ValueError(f"policy {self.policy.name!r} chose {arm}: drafter {arm.drafter!r} is not deployed "
                             f"(drafters: {list(self.drafters)})")

    def step(self, now: float) -> None:
        """Run one step starting at ``now``; sets ``busy_until`` to its end (inf: idle)."""
        self._admit()
        if not self.prefilling and not self.n_active:
            self.busy_until = np.inf
            return
        self.steps += 1
        dec = np.flatnonzero(self.active & (self.prefill_left == 0))
        cls_dec = self.cls[dec]
        order = np.argsort(cls_dec, kind="stable")  # grouped by class
        dec = dec[order]
        counts = np.bincount(cls_dec, minlength=len(self.classes))
        n_active = self.n_active
        load = Load(n_active, len(self.queue) + self.last_starved, self.last_verify_tokens, self.last_context)
        n_dec = dec.size
        accepted = np.zeros(n_dec, dtype=np.int64)
        proposed = np.zeros(n_dec, dtype=np.int64)  # drafted tokens to verify
        forwards = np.zeros(n_dec, dtype=np.int64)  # draft-model forwards each request ran
        is_draft = np.zeros(n_dec, dtype=bool)
        groups = []  # (class, arm, start, stop, confidences or None, every request proposed k)
        start = 0
        ngram = 0
        deciding = np.flatnonzero(counts).tolist()
        arms = self.policy.choose_many([self._names[c] for c in deciding], load)
        selects = getattr(self.policy, "selects_tokens", False)
        pending = []  # (lo, hi, confidence, accepted-if-verified) awaiting the policy's selection
        for c, arm in zip(deciding, arms):
            n = int(counts[c])
            lo, hi = start, start + n
            conf = None
            full = True
            if arm.k > 0:
                self._check(arm)
                model = self.classes[c].at(now).get(arm.drafter)
                if isinstance(model, ConfidenceAcceptance):
                    conf, ok = model.sample_confidence(arm.k, n, self.rng)
                    lead = np.cumprod(ok, axis=1).sum(axis=1)
                    if selects:
                        pending.append((lo, hi, conf, lead))
                        m = np.full(n, arm.k)
                        full = False
                    elif arm.min_confidence:
                        m = np.cumprod(conf >= arm.min_confidence, axis=1).sum(axis=1)
                        full = False
                    else:
                        m = arm.k
                    accepted[lo:hi] = np.minimum(lead, m)
                    proposed[lo:hi] = m
                    # the forward that produced a token below the threshold ran too
                    forwards[lo:hi] = np.minimum(m + (m < arm.k), arm.k) if arm.min_confidence else arm.k
                elif isinstance(model, RecordedAcceptance):
                    # what the live drafter proposed: n-gram lookup often finds fewer than k
                    # (or none), and the verification pass carries only what was proposed
                    rows = dec[lo:hi]
                    proposed[lo:hi], accepted[lo:hi] = model.sample_proposed(
                        arm.k, n, self.rng, self._prompts(rows), self.req.output_tokens[self.rid[rows]] -
                        self.remaining[rows], np.maximum(self.remaining[rows] - 1, 0))
                    forwards[lo:hi] = arm.k
                    full = False
                else:
                    accepted[lo:hi] = model.sample(arm.k, n, self.rng)
                    proposed[lo:hi] = arm.k
                    forwards[lo:hi] = arm.k
                if arm.drafter == "draft":
                    is_draft[lo:hi] = True
                else:
                    ngram += n
            groups.append((int(c), arm, lo, hi, conf, full))
            start = hi
        context = int(self.ctx[dec].sum())
        mean_ctx = context / n_dec if n_dec else 0.0
        if pending:  # vLLM-style adaptive verification: the policy picks the tokens to verify
            rows = np.concatenate([np.arange(lo, hi) for lo, hi, _, _ in pending])
            kmax = max(p[2].shape[1] for p in pending)
            conf_all = np.zeros((rows.size, kmax))
            o = 0
            for lo, hi, cf, _ in pending:
                conf_all[o:o + hi - lo, : cf.shape[1]] = cf
                o += hi - lo
            fixed = self.cost.step(0, 0, self._draft_batch(forwards, is_draft), ngram, mean_ctx, requests=n_dec)
            pick = self.policy.select(conf_all, n_dec + min(self._backlog_chunk(), self.max_tokens), context,
                                      fixed.draft_s + fixed.other_s)
            proposed[rows] = np.minimum(proposed[rows], pick)
            accepted[rows] = np.minimum(accepted[rows], proposed[rows])
        # the engine asks for no more candidates than the request has tokens left after the
        # one this step samples anyway (``Engine._k_for``): a short answer's last steps verify less
        cap = np.maximum(self.remaining[dec] - 1, 0)
        over = proposed > cap
        if over.any():
            proposed = np.minimum(proposed, cap)
            accepted = np.minimum(accepted, proposed)
            forwards = np.minimum(forwards, cap)
            groups = [(c, arm, lo, hi, conf, full and not over[lo:hi].any()) for c, arm, lo, hi, conf, full in groups]
        # the step's token budget: decode and verification first, in a rotating order
        decode_tokens = n_dec + int(proposed.sum())
        scheduled = None  # None: every decoding request runs in full
        if decode_tokens > self.max_tokens and n_dec:
            want = 1 + proposed
            order = np.roll(np.arange(n_dec), -(self.steps % n_dec))
            give = np.zeros(n_dec, dtype=np.int64)
            cum = np.cumsum(want[order])
            give[order] = np.clip(self.max_tokens - (cum - want[order]), 0, want[order])
            scheduled = give > 0
            trimmed = give < want
            proposed = np.maximum(give - 1, 0)
            accepted = np.minimum(accepted, proposed)
            forwards = np.where(trimmed, proposed, forwards) * scheduled
            is_draft &= scheduled
            ngram = sum(int(scheduled[lo:hi].sum()) for c, arm, lo, hi, _, _ in groups if arm.drafter == "ngram")
            decode_tokens = int(give.sum())
            groups = [(c, arm, lo, hi, conf, full and not trimmed[lo:hi].any()) for c, arm, lo, hi, conf, full in groups]
        budget = max(self.max_tokens - decode_tokens, 0)
        prompt_order = self.prefilling
        held = False  # the pacer held prompt work back this step (by choice, not for lack of room)
        if self.pacer is not None and self.prefilling:
            arrival = self.req.arrival_s
            prompt_order = sorted(self.prefilling, key=lambda s: self.pacer.deadline(self._names[self.cls[s]],
                                                                                     float(arrival[self.rid[s]])))
            if budget > 0 and n_dec:
                rows = np.arange(n_dec) if scheduled is None else np.flatnonzero(scheduled)
                waiting = [(self._names[self.cls[s]], int(self.prefill_left[s]), now - float(arrival[self.rid[s]]))
                           for s in prompt_order]
                paced = self.pacer.prompt_budget([self._names[c] for c in np.unique(self.cls[dec[rows]])],
                                                 decode_tokens, waiting, budget, blocked=bool(self.queue))
                held, budget = paced < budget, paced
        prefill_tokens = 0
        chunks = []
        for s in prompt_order:
            if budget <= 0:
                break
            take = min(int(self.prefill_left[s]), budget)
            chunks.append((s, take))
            budget -= take
            prefill_tokens += take
        verify_tokens = prefill_tokens + decode_tokens
        # the step's context as the engine counts it and pays for it: every row's request's tokens
        # already in the cache (a prompt chunk's cached prefix and earlier chunks too); the policy
        # is shown the decoding requests' (``context``), which its cost models take
        step_context = context + sum(int(self.ctx[s]) for s, _ in chunks)
        draft_batch = self._draft_batch(forwards, is_draft)
        n_run = n_dec if scheduled is None else int(scheduled.sum())
        t = self.cost.step(verify_tokens, step_context, draft_batch, ngram, mean_ctx, prompt_tokens=prefill_tokens,
                           requests=n_run)
        end = now + t.wall_s
        rec = self.rec
        b = rec.bin(end)
        emitted = np.minimum(accepted + 1, self.remaining[dec])
        if scheduled is not None:
            emitted *= scheduled
        self.remaining[dec] -= emitted
        self.ctx[dec] += emitted
        emitted_total = int(emitted.sum())
        outcome_groups = []
        for c, arm, lo, hi, conf, full in groups:
            if scheduled is None:
                acc, m, em = accepted[lo:hi], proposed[lo:hi], emitted[lo:hi]
                sel = None
            else:
                sel = scheduled[lo:hi]
                acc, m, em = accepted[lo:hi][sel], proposed[lo:hi][sel], emitted[lo:hi][sel]
            n = acc.size
            if n == 0:
                continue
            a_sum = int(acc.sum())
            if rec.request_arms is not None:
                key = arm_key(arm)
                rids = self.rid[dec[lo:hi]] if sel is None else self.rid[dec[lo:hi]][sel]
                for r in rids.tolist():
                    per = rec.request_arms.setdefault(r, {})
                    per[key] = per.get(key, 0) + 1
            col = rec.arm_slot(arm)  # first: a new arm grows arm_counts
            rec.arm_counts[c, b, col] += n
            rec.accepted_n[c, b] += n
            rec.accepted_sum[c, b] += a_sum + n
            hist = np.bincount(acc, minlength=arm.k + 1)
            H = None
            if arm.k and not full and (m < arm.k).any():
                H = np.zeros((arm.k + 1, arm.k + 1))
                np.add.at(H, (m, acc), 1.0)
            cc = None
            if conf is not None:
                cc = self._confidence(conf if sel is None else conf[sel], m if m.ndim else np.full(n, arm.k), acc, arm)
            outcome_groups.append(GroupOutcome(self._names[c], arm, hist, int(em.sum()), n,
                                               arm.k * n if full else int(m.sum()), H, cc))
        done = dec[self.remaining[dec] <= 0]
        if done.size:
            self._finish(done, end)
        for s, take in chunks:
            self.prefill_left[s] -= take
            self.prefill_tokens_left -= take
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
        # prompts the pacer held back are not a queue: the replica is not short of capacity (a
        # policy that reads a queue as "capacity alone" would drop the TPOT targets pacing keeps)
        self.last_starved = 0 if held else max(
            len(self.prefilling) - sum(1 for s, _ in chunks if self.prefill_left[s] > 0), 0)
        rec.step_end.append(end)
        rec.step_wall.append(t.wall_s)
        rec.step_decoding.append(n_dec)
        rec.step_emitted.append(emitted_total)
        if rec.step_shapes is not None:
            rec.step_shapes.append([end, n_run, prefill_tokens,
                                    decode_tokens, step_context, ngram, t.draft_s, t.verify_s, t.other_s,
                                    *(int(x) for x in draft_batch if x > 0)])
        self.last_verify_tokens, self.last_context = verify_tokens, context
        if self.admission is not None:
            # a step the pacer held back does not show the rate the replica can prefill at
            self.admission.observe(t.wall_s, prefill_tokens, bool(self.queue) or (bool(self.prefilling) and not held))
        if self.pacer is not None:
            self.pacer.observe(t.wall_s, decode_tokens, prefill_tokens,
                               {g.request_class: (g.emitted, g.num_requests) for g in outcome_groups})
        self.policy.observe(StepOutcome(n_active, prefill_tokens, verify_tokens, context, t.draft_s, t.verify_s,
                                        t.other_s, t.wall_s, outcome_groups, len(self.queue), 0.0, len(chunks)))
        a, b = self.host_gap
        self.busy_until = end + a + b * (n_dec + len(chunks)) if (a or b) and (self.n_active or self.queue) else end

    def _backlog_chunk(self) -> int:
        return self.prefill_tokens_left

    def _draft_batch(self, forwards: np.ndarray, is_draft: np.ndarray) -> np.ndarray:
        """[max_k] requests running the draft model at each position."""
        f = forwards[is_draft]
        if f.size == 0:
            return np.zeros(self.max_k)
        n_at = np.bincount(np.minimum(f, self.max_k), minlength=self.max_k + 1)
        return np.add.accumulate(n_at[::-1])[::-1][1:].astype(float)  # requests with forwards > j

    @staticmethod
    def _confidence(conf: np.ndarray, m: np.ndarray, acc: np.ndarray, arm: Arm) -> ConfidenceCounts:
        """What the engine would report: confidences of the drafted tokens and their fate."""
        k = conf.shape[1]
        bins = conf_bin(conf)  # [n, k]
        pos = np.arange(k)[None, :]
        cc = ConfidenceCounts.empty(k)
        if not arm.min_confidence:
            drafted = pos < m[:, None]
            cc.seen[:] = np.bincount((pos * CONF_BINS + bins)[drafted], minlength=k * CONF_BINS).reshape(k, CONF_BINS)
        ok = pos < acc[:, None]
        cc.accepted[:] = np.bincount(bins[ok], minlength=CONF_BINS)
        bad = (pos == acc[:, None]) & (acc[:, None] < m[:, None])
        cc.rejected[:] = np.bincount(bins[bad], minlength=CONF_BINS)
        return cc

    def _finish(self, slots: np.ndarray, end: float) -> None:
        r = self.rid[slots]
        self.rec.finish_s[r] = end
        self.active[slots] = False
        self.n_active -= int(slots.size)
        self.kv_used -= int((self.req.prompt_tokens[r] + self.req.output_tokens[r]).sum())
