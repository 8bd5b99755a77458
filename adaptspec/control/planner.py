"""The batch picture a policy keeps, and the planner that picks a class's arm within it.

A request's arm changes the whole batch's step time, so an arm is judged by the goodput of
the batch it joins: (emitted tokens of every request) / (predicted step time, less a prefill
pass of its own, which no arm changes; latency targets count it). The rest of
the batch is taken from the last observed step (its class mix, arms, prefill tokens and
context), scaled to the current batch size.

Latency targets: a class with a TPOT target only takes arms whose predicted per-token
latency (step time / accepted length) is within ``margin * target``; every class's arm must
also keep the step time within the TPOT budget of every latency class in the batch (each
class's budget computed with at least its best one-candidate accepted length, see
``ArmTable.budget_length``). Among feasible arms the planner maximises goodput. When none is
feasible (a long step: a burst of prefill, a full batch), it takes the arm with the smallest
worst-case ratio of predicted step time to budget, i.e. the one that comes closest to every
latency class's target (ties within ``RATIO_TIE`` broken by goodput); but while requests
wait for admission (a backlog that only throughput clears, and whose TTFT depends on it) it
takes the best goodput.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from adaptspec.control.costmodel import StepCostModel
from adaptspec.control.types import NO_SPEC, Arm, ClassTarget, Load, StepOutcome


@dataclass(slots=True)
class ArmTable:
    """The candidate arms as arrays: index 0 is no speculation."""

    arms: list[Arm]
    k: np.ndarray  # [A]
    is_draft: np.ndarray  # [A] bool
    is_ngram: np.ndarray  # [A] bool
    below_k: np.ndarray  # [A, K] bool: position j (0-based) is drafted by the arm
    positions: dict[Arm, int] = field(default_factory=dict)
    k_draft: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [A] k if the draft model, else 0
    ngram_f: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [A] 1.0 for n-gram arms
    kp1: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [A] k + 1

    @classmethod
    def build(cls, drafters: tuple[str, ...], max_k: int) -> "ArmTable":
        arms = [NO_SPEC] + [Arm(d, k) for d in drafters if d != "none" for k in range(1, max_k + 1)]
        k = np.array([a.k for a in arms])
        return cls(
            arms,
            k,
            np.array([a.drafter == "draft" for a in arms]),
            np.array([a.drafter == "ngram" for a in arms]),
            np.arange(max_k)[None, :] < k[:, None],
            {a: i for i, a in enumerate(arms)},
            (k * np.array([a.drafter == "draft" for a in arms])).astype(float),
            np.array([a.drafter == "ngram" for a in arms], dtype=float),
            (k + 1).astype(float),
        )

    def index(self, arm: Arm) -> int:
        """Position of ``arm``; an arm outside the table counts as no speculation."""
        return self.positions.get(arm, 0)

    def budget_length(self, lengths: np.ndarray, arm: Arm) -> float:
        """Accepted length a class's TPOT budget on the others is computed with: its current
        arm's, but at least its best one-candidate arm's. Any class reaches that length for
        about one draft token per request, so a class that dropped to no drafting for a step
        must not shrink every other class's budget to one token per step (near saturation
        that fed back into the whole batch collapsing to no speculation)."""
        one = self.k == 1
        floor = float(lengths[one].max()) if one.any() else 1.0
        return max(float(lengths[self.index(arm)]), floor)


# how fast a class's fill (candidates proposed / asked for) forgets: per observed group
FILL_DISCOUNT = 0.98
FILL_PRIOR = 4.0  # candidates of "proposes all k" a class starts from (a weak prior)


@dataclass(slots=True)
class ClassSlot:
    share: float = 0.0  # fraction of the last step's decoding requests
    arm: Arm = NO_SPEC
    emitted_per_request: float = 1.0
    # per drafter, discounted (candidates proposed, candidates asked for): n-gram lookup
    # proposes nothing when the context has no match, so its requests verify fewer than k + 1
    # tokens (the chat prompts: about a third of the candidates asked for at k = 2)
    proposed: dict[str, list[float]] = field(default_factory=dict)

    def fill(self, drafter: str) -> float:
        """Expected fraction of the k candidates asked for that ``drafter`` proposes."""
        p = self.proposed.get(drafter)
        return 1.0 if p is None else (p[0] + FILL_PRIOR) / (p[1] + FILL_PRIOR)

    def observe_proposed(self, drafter: str, drafted: int, asked: int) -> None:
        p = self.proposed.setdefault(drafter, [0.0, 0.0])
        p[0] = p[0] * FILL_DISCOUNT + drafted
        p[1] = p[1] * FILL_DISCOUNT + asked


@dataclass(slots=True)
class BatchPicture:
    """What the last observed steps say about the batch (discounted averages)."""

    classes: dict[str, ClassSlot] = field(default_factory=dict)
    prefill_tokens: float = 0.0
    context_per_request: float = 0.0
    decoding: float = 1.0
    smoothing: float = 0.2
    version: int = 0  # bumped by every observed step
    emitted: float = 0.0  # tokens emitted per step

    def observe(self, step: StepOutcome) -> None:
        s = self.smoothing
        self.version += 1
        n_dec = sum(g.num_requests for g in step.groups)
        self.prefill_tokens += s * (step.num_prefill - self.prefill_tokens)
        self.emitted += s * (sum(g.emitted for g in step.groups) - self.emitted)
        if n_dec:
            self.context_per_request += s * (step.context_tokens / n_dec - self.context_per_request)
            self.decoding += s * (n_dec - self.decoding)
        seen: dict[str, tuple[int, int, Arm, int]] = {}
        for g in step.groups:
            n = g.num_requests
            if g.arm.k > 0 and n > 0:
                self._slot(g.request_class).observe_proposed(g.arm.drafter, g.drafted, g.arm.k * n)
            tot, emi, arm, best = seen.get(g.request_class, (0, 0, g.arm, 0))
            if n > best:
                arm, best = g.arm, n
            seen[g.request_class] = (tot + n, emi + g.emitted, arm, best)
        for c, slot in self.classes.items():
            if c not in seen:
                slot.share = slot.share * (1 - s) if slot.share > 1e-4 else 0.0
        for c, (tot, emi, arm, _) in seen.items():
            slot = self._slot(c)
            slot.share += s * (tot / max(n_dec, 1) - slot.share)
            slot.arm = arm
            slot.emitted_per_request += s * (emi / tot - slot.emitted_per_request)

    def _slot(self, request_class: str) -> ClassSlot:
        slot = self.classes.get(request_class)
        if slot is None:
            slot = self.classes[request_class] = ClassSlot()
        return slot


# ratios of predicted step time to budget closer than this are ties: the cost model's step
# times are accurate to a few percent (the load sweep's mean predicted and observed step
# times agree within 1-3%), so finer distinctions are noise and throughput breaks them
RATIO_TIE = 0.02
REFRESH_STEPS = 4  # the batch mix changes slowly: recompute it every few observed steps
_NO_K = np.zeros(1)  # "k_draft" of a whole-batch prediction (one array: the cost model caches by its id)


@dataclass(slots=True)
class _Mix:
    """The rest of the batch as seen by one class, per request of the others."""

    share: float  # this class's fraction of decoding requests
    own_tokens: np.ndarray  # [A] verify tokens per request of this class with each arm (1 + proposed)
    tokens: float  # verify tokens per other request
    emitted: float  # emitted tokens per other request
    draft: np.ndarray  # [K] fraction of other requests drafting with the draft model at j
    ngram: float  # fraction of other requests drafting with n-gram lookup
    depth: int  # deepest position any other request drafts with the draft model
    budget: float  # step-time budget set by other classes' TPOT targets (inf: none)


@dataclass(slots=True)
class Planner:
    table: ArmTable
    targets: dict[str, ClassTarget]
    margin: float = 0.9
    _mixes: dict[str, _Mix] = field(default_factory=dict)
    _version: int = -1

    def _mix(self, request_class: str, picture: BatchPicture, others_length: dict[str, float],
             others_budget: dict[str, float] | None) -> _Mix:
        if picture.version - self._version >= REFRESH_STEPS or picture.version < self._version:
            self._mixes.clear()
            self._version = picture.version
        mix = self._mixes.get(request_class)
        if mix is not None:
            return mix
        slots = picture.classes
        K = self.table.below_k.shape[1]
        total = sum(s.share for s in slots.values())
        mine = slots.get(request_class)
        my_share = mine.share if mine is not None else 0.0
        other_total = total - my_share
        share = my_share / total if my_share > 0 else 1.0 / (len(slots) + 1)
        tokens = emitted = ngram = 0.0
        draft = np.zeros(K)
        budget = np.inf
        own = self._own_tokens(mine)
        for c, s in slots.items():
            if c == request_class or s.share <= 0 or other_total <= 0:
                continue
            L_c = others_length.get(c, 1.0)
            tgt = self.targets.get(c)
            if tgt is not None and tgt.tpot_s is not None:
                L_b = others_budget.get(c, L_c) if others_budget is not None else L_c
                budget = min(budget, self.margin * tgt.tpot_s * L_b)
            w = s.share / other_total
            tokens += w * (1.0 + s.fill(s.arm.drafter) * s.arm.k)
            emitted += w * L_c
            if s.arm.drafter == "draft":
                draft[: s.arm.k] += w
            elif s.arm.drafter == "ngram":
                ngram += w
        mix = self._mixes[request_class] = _Mix(share, own, tokens, emitted, draft, ngram,
                                                int(np.count_nonzero(draft)), budget)
        return mix

    def _own_tokens(self, slot: ClassSlot | None) -> np.ndarray:
        """[A] verify tokens per request of a class with each arm: 1 + the candidates its
        drafter is expected to propose (k + 1 until the class has shown otherwise)."""
        t = self.table
        if slot is None or not slot.proposed:
            return t.kp1
        f = np.where(t.is_ngram, slot.fill("ngram"), np.where(t.is_draft, slot.fill("draft"), 0.0))
        return 1.0 + f * t.k

    def plan(
        self,
        request_class: str,
        load: Load,
        picture: BatchPicture,
        accepted_length: np.ndarray,  # [A] expected accepted length of each arm for this class
        others_length: dict[str, float],  # expected accepted length of other classes' arms
        cost: StepCostModel,
        others_budget: dict[str, float] | None = None,  # accepted lengths for others' TPOT budgets
        tpot_length: np.ndarray | None = None,  # [A] accepted length this class's TPOT is budgeted with
    ) -> int:
        """Index (in the arm table) of the best feasible arm for ``request_class``.

        ``others_budget`` (default: ``others_length``) gives the accepted length each other
        latency class's TPOT budget is computed with (see ``ArmTable.budget_length``);
        ``tpot_length`` (default: ``accepted_length``) the one this class's own TPOT is
        (see ``acceptance.tpot_length_curve``: the mean less the spread a short request sees)."""
        return self.plan_many([request_class], load, picture, accepted_length[None, :], others_length, cost,
                              others_budget, None if tpot_length is None else tpot_length[None, :])[0]

    def plan_many(
        self,
        classes: list[str],
        load: Load,
        picture: BatchPicture,
        accepted_length: np.ndarray,  # [C, A] per deciding class
        others_length: dict[str, float],
        cost: StepCostModel,
        others_budget: dict[str, float] | None = None,
        tpot_length: np.ndarray | None = None,  # [C, A]
    ) -> list[int]:
        """``plan`` for several classes under the same load in one pass (a step's snapshot).

        Each class is planned against the batch picture alone, not against the others' new
        choices, so row ``i`` is exactly ``plan(classes[i], ...)``; the arrays just carry a
        row per class, which costs about what one class does."""
        t = self.table
        C = len(classes)
        B = max(load.batch_size, 1)
        ctx = load.context_tokens or picture.context_per_request * B
        K = t.below_k.shape[1]
        col = np.empty((6, C, 1))  # per class: verify base, n_c, n-gram base, emitted base, TPOT scale, budget
        own_tokens = np.empty((C, len(t.arms)))
        draft_other = np.empty((C, K))
        depth = np.empty(C, dtype=np.intp)  # the draft forwards the others need (0 when there are none)
        for i, c in enumerate(classes):
            mix = self._mix(c, picture, others_length, others_budget)
            n_c = max(B * mix.share, 1.0)
            n_o = max(B - n_c, 0.0)
            tgt = self.targets.get(c)
            draft_other[i] = n_o * mix.draft
            own_tokens[i] = mix.own_tokens
            depth[i] = mix.depth if n_o > 0 else 0
            col[:, i, 0] = (picture.prefill_tokens + n_o * mix.tokens, n_c, n_o * mix.ngram, n_o * mix.emitted,
                            self.margin * tgt.tpot_s if tgt is not None and tgt.tpot_s is not None else np.inf,
                            mix.budget)
        verify0, n_c, ngram0, emitted0, scale, budget = col
        verify = verify0 + n_c * own_tokens
        ngram = ngram0 + n_c * t.ngram_f
        T = _predict_rows(cost, verify, ctx, draft_other, n_c, t.k_draft, ngram, ctx / B, draft_depth=depth)
        # with requests waiting, a step also serves prefill work (the chunk it carries):
        # value it in decode-token equivalents, so long steps pay for delaying admission
        backlog = picture.emitted if load.queued > 0 and picture.prefill_tokens > 0 else 0.0
        goodput = (emitted0 + n_c * accepted_length + backlog) / T
        # a prefill pass of its own (the live engine's) adds to every step whatever the arms:
        # left out of goodput (each request prefills once, so it is no cost of an arm), counted
        # against latency targets (StepOutcome.prefill_s)
        prefill = getattr(cost, "prefill_s", 0.0)
        T_lat = T + prefill if prefill > 0 else T
        # the step time that keeps each class's TPOT in target (its own, and every other
        # latency class's budget); inf where neither applies, so the best goodput wins
        # (fmin: a class without a target has scale inf, and a length of 0 times inf is nan)
        limit = (accepted_length if tpot_length is None else tpot_length) * scale
        np.fmin(limit, budget, out=limit)
        masked = np.where(T_lat <= limit, goodput, -np.inf)
        out = masked.argmax(axis=1)
        top = np.maximum.reduce(masked, axis=1)
        if -np.inf in top.tolist():
            stuck = top == -np.inf
            # nothing feasible for these classes (a long step: a burst of prefill, a full
            # batch). With requests waiting for admission, their TTFT hangs on throughput
            # alone: take the best goodput. Otherwise the best goodput would hand the step to
            # the very arms that make the latency classes miss; take the arm closest to every
            # target instead, the smallest worst-case ratio of predicted step time to budget
            # (T / limit), counting ratios within RATIO_TIE of it as ties that goodput breaks.
            if load.queued > 0:
                fallback = goodput.argmax(axis=1)
            else:
                r = T_lat / limit
                close = r <= np.minimum.reduce(r, axis=1, keepdims=True) * (1.0 + RATIO_TIE)
                fallback = np.where(close, goodput, -np.inf).argmax(axis=1)
            out = np.where(stuck, fallback, out)
        return self._share_the_draft(out.tolist(), classes, load, picture, accepted_length, cost, goodput,
                                     own_tokens)

    def _share_the_draft(self, out: list[int], classes: list[str], load: Load, picture: BatchPicture,
                         accepted_length: np.ndarray, cost: StepCostModel, goodput: np.ndarray,
                         own_tokens: np.ndarray) -> list[int]:
        """Reconsider, jointly, the classes that chose the draft model.

        Each class is planned against the batch picture, where the others keep their arms, so
        a draft forward that another class pays for looks nearly free to it: two classes on
        the draft model each see it as cheap and neither sees the move of both leaving it (no
        draft forward at all). When the deciding classes are the whole batch and none has a
        latency target, this prices the whole step for every subset of the drafting classes
        moving to their best arm without the draft model and keeps the best goodput (the
        empty subset is the per-class plan). Only for steps of two requests or more: at one
        client the classes take turns, each step pays its own draft forward, and the
        per-class plan already charges it in full."""
        if self.targets:
            return out
        t = self.table
        drafting = [i for i, a in enumerate(out) if t.is_draft[a]]
        if not drafting:
            return out
        deciding = set(classes)
        if any(s.share > 0 and c not in deciding for c, s in picture.classes.items()):
            return out
        B = max(load.batch_size, 1)
        if B < 2:  # one request a step: the classes take turns and share no forward
            return out
        n = np.array([B * self._mixes[c].share for c in classes])
        alt = np.where(t.is_draft, -np.inf, goodput[drafting]).argmax(axis=1)
        leave = (np.arange(1 << len(drafting))[:, None] >> np.arange(len(drafting))) & 1  # [R, D] subsets
        arms = np.tile(np.asarray(out), (leave.shape[0], 1))
        arms[:, drafting] = np.where(leave == 1, alt, arms[:, drafting])
        rows = np.arange(len(classes))
        verify = picture.prefill_tokens + (n * own_tokens[rows, arms]).sum(axis=1)
        draft = (n[None, :, None] * (t.below_k[arms] & t.is_draft[arms][..., None])).sum(axis=1)  # [R, K]
        ngram = (n * t.is_ngram[arms]).sum(axis=1)
        emitted = (n * accepted_length[rows, arms]).sum(axis=1)
        ctx = load.context_tokens or picture.context_per_request * B
        T = _predict_rows(cost, verify[:, None], ctx, draft, np.zeros((len(arms), 1)), _NO_K, ngram[:, None],
                          ctx / B)[:, 0]
        return arms[int(np.argmax(emitted / T))].tolist()


def _predict_rows(cost: StepCostModel, verify, ctx, draft, n_c, k_draft, ngram, per_request, **batched_kw):
    """Step times of R rows of candidates ([R, ...] arguments, ``n_c`` [R, 1]): one call on a
    cost model that takes rows (``batched``), else one call per row."""
    if getattr(cost, "batched", False):
        return cost.predict(verify, ctx, draft, n_c, k_draft, ngram, per_request, **batched_kw)
    return np.stack([np.asarray(cost.predict(verify[i], ctx, draft[i], float(n_c[i, 0]), k_draft, ngram[i],
                                             per_request), dtype=float) for i in range(len(verify))])
