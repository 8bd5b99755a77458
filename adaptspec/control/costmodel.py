"""Step-cost models: the protocol the planner uses, and the online model fitted from steps.

A step = draft (k sequential forwards of the draft model over the requests still drafting
at each position, or n-gram lookups) + one batched target verification pass over
``verify_tokens`` tokens reading ``context_tokens`` of KV cache + fixed overhead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from adaptspec.control.types import StepOutcome

# hinge knots (tokens) of the piecewise-linear verify curve: flat while memory-bound,
# then rising once the pass turns compute-bound. The knots at 8-32 follow small batches on
# a CPU, where the curve bends within a few tokens (SmolLM2 fp32: 18 ms at 4 tokens, 22 at
# 8, 32 at 16, 58 at 32); with 64 as the first knot one line spanned 0-64 and priced 8-12
# tokens 25% too high, so the policy never tried n-gram lookup at 4 clients, where it paid
VERIFY_KNOTS = (8.0, 16.0, 32.0, 64.0, 256.0, 1024.0, 4096.0)
_TOK = 1e-3  # feature scaling: thousands of tokens
# With a profile's curve kept, the prior's weight on each verify coefficient in steps' worth at
# the column's typical size (OnlineStepCost._shape_prior): the constant firmest, so that where
# live steps sit at one token count their level moves the curve's scale, not its offset
SHAPE_PRIOR_STEPS = {"constant": 100.0, "curve": 5.0, "drafted": 10.0, "context": 20.0, "prompt": 20.0}
_CTX = 1e-6  # millions of context tokens


class StepCostModel(Protocol):
    """Predicts step seconds for candidate arms of one class joining the rest of a batch.

    The draft model runs one forward per drafted position; at position j it carries the
    other classes' requests still drafting (``draft_other[j]``) plus this class's
    ``n_class`` requests when the candidate drafts with the draft model beyond j.

    A model that sets ``batched = True`` also takes several deciding classes at once (the
    planner's ``plan_many``): ``verify_tokens`` and ``ngram_requests`` [C, A],
    ``draft_other`` [C, K], ``n_class`` [C, 1], and ``draft_depth`` [C] (the nonzero
    positions of each ``draft_other`` row, which the planner knows), returning [C, A], each
    row exactly what the one-class call returns.
    """

    def predict(
        self,
        verify_tokens: np.ndarray,  # [A] tokens in the verification pass per candidate
        context_tokens: float,  # KV tokens read by the step's decoding requests
        draft_other: np.ndarray,  # [K] other requests drafting with the draft model at position j
        n_class: float,  # requests of the deciding class
        k_draft: np.ndarray,  # [A] k of each candidate if it uses the draft model, else 0
        ngram_requests: np.ndarray,  # [A] requests drafting with n-gram lookup
        mean_context: float,  # mean context per decoding request
    ) -> np.ndarray:  # [A] predicted step seconds
        ...

    def step_time(
        self,
        verify_tokens: np.ndarray,  # [...] tokens in the verification pass
        context_tokens: np.ndarray,  # [...] KV tokens read by the decoding requests
        draft_batch: np.ndarray,  # [..., K] requests drafting with the draft model at position j (may be fractional)
        ngram_requests: np.ndarray,  # [...] requests drafting with n-gram lookup
        mean_context: float,  # mean context per decoding request
    ) -> np.ndarray:  # [...] seconds of a step of that composition
        """The planner's form: whole step compositions, any leading shape (several candidate
        plans at many loads in one call). A draft position with under one request drafting
        (an expected count) costs that share of one forward."""
        ...


def draft_batch(draft_other: np.ndarray, n_class: float, k_draft: np.ndarray) -> np.ndarray:
    """[K], scalar, [A] -> [A, K] requests drafting with the draft model at each position."""
    K = draft_other.size
    return draft_other[None, :] + n_class * (np.arange(K)[None, :] < k_draft[:, None])


def verify_features(verify_tokens: np.ndarray, context_tokens: float,
                    shape: tuple[np.ndarray, np.ndarray] | None = None, prompt: float = 0.0) -> np.ndarray:
    """[A] decode and verification tokens -> design matrix [A, 2 + len(VERIFY_KNOTS) + 2] without
    ``shape``: the curve's columns (a constant, the tokens, the hinges), then the context's and the
    prompt chunks' (``prompt``: their feature, ``OnlineStepCost.prompt_feature``). With ``shape``, a
    prior's verify curve (tokens, seconds), the curve is a constant and that curve's value: [A, 2 + 2]
    (``OnlineStepCost.observe`` adds its drafted rows' column between the curve's and the context's)."""
    n = np.asarray(verify_tokens, dtype=float)
    if shape is None:
        cols = [np.ones_like(n), n * _TOK]
        cols += [np.maximum(n - kt, 0.0) * _TOK for kt in VERIFY_KNOTS]
    else:
        cols = [np.ones_like(n), np.interp(n, *shape)]
    cols.append(np.full_like(n, context_tokens * _CTX))
    cols.append(np.full_like(n, prompt))
    return np.stack(cols, axis=-1)


def draft_features(forwards: np.ndarray, tokens: np.ndarray, ngram_requests: np.ndarray,
                   mean_context: float) -> np.ndarray:
    """[A] draft forwards, [A] drafted tokens, [A] n-gram requests -> [A, 4] design matrix."""
    f = np.asarray(forwards, dtype=float)
    t = np.asarray(tokens, dtype=float)
    return np.stack([f, t * _TOK, t * mean_context * _CTX, np.asarray(ngram_requests, dtype=float) * _TOK], axis=-1)


@dataclass(slots=True)
class _DiscountedRidge:
    """y ~ x . theta, evidence discounted per update, shrunk toward a prior: a ridge toward
    theta0, plus any pseudo-observations ``seed`` absorbed (the prior is the pair A0, b0)."""

    dim: int
    discount: float
    prior_weight: float
    theta0: np.ndarray
    A: np.ndarray = field(init=False)
    b: np.ndarray = field(init=False)
    theta: np.ndarray = field(init=False)
    _dirty: bool = field(init=False, default=False)
    _A0: np.ndarray = field(init=False, repr=False)
    _b0: np.ndarray = field(init=False, repr=False)
    _keep_A: np.ndarray = field(init=False, repr=False)
    _keep_b: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._A0 = self.prior_weight * np.eye(self.dim)
        self._b0 = self.prior_weight * self.theta0.copy()
        self._reset()

    def _reset(self) -> None:
        self.A, self.b = self._A0.copy(), self._b0.copy()
        self.theta = np.linalg.solve(self.A, self.b)
        # what every update adds back of the prior, so discounting never forgets it
        self._keep_A = (1 - self.discount) * self._A0
        self._keep_b = (1 - self.discount) * self._b0

    def set_prior(self, precision: np.ndarray, theta0: np.ndarray) -> None:
        """A prior of independent coefficients instead: ``theta0`` with these precisions."""
        self._A0 = np.diag(np.asarray(precision, dtype=float))
        self._b0 = self._A0 @ np.asarray(theta0, dtype=float)
        self._reset()

    def seed(self, X: np.ndarray, y: np.ndarray, weight: float) -> None:
        """Add pseudo-observations (from a profile) to the prior. Calls accumulate: seeding
        the same curve at three contexts fits all three together (each call used to become the
        ridge centre of the next, with an equal weight on every coefficient, so a coefficient
        only the later calls could see, the context term, was pulled to the first call's 0)."""
        self._A0 = self._A0 + weight * X.T @ X
        self._b0 = self._b0 + weight * X.T @ y
        self._reset()

    def update(self, x: np.ndarray, y: float) -> None:
        g = self.discount
        self.A *= g
        self.A += self._keep_A
        self.A += x[:, None] * x
        self.b *= g
        self.b += self._keep_b
        self.b += y * x
        self._dirty = True

    def coef(self) -> np.ndarray:
        if self._dirty:
            self.theta = np.linalg.solve(self.A, self.b)
            self._dirty = False
        return self.theta


# np.interp's compiled core: the public wrapper's argument checks cost more than the
# interpolation of a few dozen points (same result; the wrapper where the core is absent)
_interp = getattr(getattr(np, "_core", getattr(np, "core", None)).multiarray, "interp", np.interp)
_XS = np.array((0.0,) + VERIFY_KNOTS + (1e6,))
_BASIS = verify_features(_XS, 0.0)[:, :-2]  # the verify curve at its knots, per coefficient


@dataclass(slots=True)
class OnlineStepCost:
    """Step cost learned online from observed steps; no offline profile required.

    verify_s ~ piecewise-linear(tokens) + c * context_tokens without a prior's curve (over all of a
    step's tokens); with one (``seed_from``), over the decode and verification tokens:
    verify_s ~ a + b * the prior's curve + g * the prior's price of the step's drafted rows (those
    beyond one a request) + c * context_tokens + p * the prior's price of its prompt chunks
    (``prompt_feature``, ``chunk_s``), times a local correction at the token counts steps visit
    (``_local_fit``);
    draft_s ~ d0 * forwards + d1 * drafted tokens + d2 * drafted tokens * context + g * n-gram requests;
    other_s ~ discounted mean. Optionally seeded from a profile (``seed_from``).

    A prefill pass of its own (``StepOutcome.prefill_s``, the live engine's) is not part of a
    prediction: the arms do not change it. ``prefill_s`` keeps its discounted mean per step,
    which the planner adds to the step time it holds against latency targets.
    """

    discount: float = 0.998
    prior_weight: float = 1e-6
    # with a profile's curve: a column for the tokens beyond one a decoding request (see observe);
    # False: the curve alone prices them
    composition: bool = True
    verify: _DiscountedRidge = field(init=False)
    draft: _DiscountedRidge = field(init=False)
    other_s: float = field(init=False, default=0.0)
    prefill_s: float = field(init=False, default=0.0)  # mean per step of a separate prefill pass
    # the seeding profile's verify curve (tokens, seconds), a column of the verify fit: see seed_from
    _shape: tuple[np.ndarray, np.ndarray] | None = field(init=False, default=None)
    _other_w: float = field(init=False, default=0.0)
    steps: int = field(init=False, default=0)
    _stale: bool = field(init=False, default=True)
    _xs: np.ndarray = field(init=False, default_factory=lambda: _XS)
    _basis: np.ndarray = field(init=False, default_factory=lambda: _BASIS)  # the verify features at _xs
    _ys: np.ndarray = field(init=False, default=None)
    _ctx_coef: float = field(init=False, default=0.0)
    # the prompt chunks' column: its coefficient (see prompt_feature), and the seeding
    # profile's price of chunks (prompt tokens, decode tokens: arrays) -> seconds, where it has a
    # prompt table (``ProfileCostModel.prompt_s_many``)
    prompt_coef: float = field(init=False, default=0.0)
    _prompt_table: object = field(init=False, default=None)
    _dl: list = field(init=False, default=None)
    # The local correction, with a profile's curve only (``_local_fit``): per point of _xs, rows
    # (steps, verify seconds, context tokens, decode tokens, drafted rows' column) discounted sums
    # over the steps without prompt chunks seen there (decode tokens nearest it); and the kernel
    # between the points
    local_pseudo: float = 8.0  # steps' worth of pull toward the fit at every point (inf: no correction)
    local_width: float = 0.3  # the kernel's width in log tokens (neighbours share their ratio)
    _local: np.ndarray | None = field(init=False, default=None)  # [5, len(_xs)]
    _lk: np.ndarray | None = field(init=False, default=None)
    # the drafted rows' column (with a profile's curve): its coefficient, and the curve table with
    # that coefficient times the profile's curve folded in (see _with_drafted)
    _drafted_coef: float = field(init=False, default=0.0)
    _ys_d: np.ndarray = field(init=False, default=None)
    _fwd: dict = field(init=False, default_factory=dict)
    _fwd_keep: list = field(init=False, default_factory=list)  # keeps cached arrays' ids valid

    def __post_init__(self) -> None:
        if not (self.local_pseudo > 0 and self.local_width > 0):
            raise ValueError(f"local_pseudo, local_width: must be > 0, got {self.local_pseudo}, {self.local_width}")
        dv = 4 + len(VERIFY_KNOTS)
        self.verify = _DiscountedRidge(dv, self.discount, self.prior_weight, np.zeros(dv))
        self.draft = _DiscountedRidge(4, self.discount, self.prior_weight, np.zeros(4))

    def seed_from(self, model: StepCostModel, *, max_tokens: int = 4096, max_k: int = 8, weight: float = 0.05,
                  keep_shape: bool = True) -> None:
        """Seed the prior from ``model`` (e.g. a profile): with ``keep_shape``, its verify curve becomes
        the fit's curve and the verify coefficients get a prior of their own (``_shape_prior``);
        without, pseudo-steps predicted by it (``weight`` a step). The draft part: pseudo-steps."""
        # the profile's fixed per-step overhead is the "other" part here, learned on its own:
        # seeded there, not into the verify curve (predict adds other_s to it)
        overhead = float(getattr(model, "step_overhead_s", 0.0))
        # The profile's verify curve itself becomes a column of the fit, so the learned curve keeps
        # its steps: a CPU's matrix kernels work in blocks of rows, and the pass over 9 tokens took
        # 28% longer than over 8 (SmolLM2 fp32, AVX2), where the hinges at 8, 16, ... spread such a
        # step over the segment and priced one more request's token at 20 times its cost. The live
        # steps then fit its scale (another machine's profile: a slower or faster copy of it). The
        # hinges go with it: the local correction bends the curve where live steps are seen, and
        # free hinges beside the drafted rows' column bent it at will where a load's steps visit a
        # few counts (there the two explain the same steps).
        if keep_shape and self.steps == 0 and self._shape is None:
            grid = np.unique(np.concatenate([np.arange(1.0, 65.0), np.geomspace(64, max_tokens, 24).round()]))
            empty = np.zeros(grid.size)
            curve = model.predict(grid, 0.0, np.zeros(max_k), 0.0, empty, empty, 0.0) - overhead
            self._shape = (grid, np.asarray(curve, dtype=float))
            # the curve bends at the knots and at the profile's points: evaluate it at all of them
            self._xs = np.union1d(_XS, grid)
            self._basis = verify_features(self._xs, 0.0, self._shape)[:, :-2]
            dv = 4 + self.composition
            self.verify = _DiscountedRidge(dv, self.discount, self.prior_weight, np.zeros(dv))
            self._local = np.zeros((5, self._xs.size))
            lx = np.log(np.maximum(self._xs, 0.5))
            self._lk = np.exp(-0.5 * ((lx[:, None] - lx[None, :]) / self.local_width) ** 2)
        # steps with a prompt chunk: the model's price of them (its prompt table where it has one,
        # else its verify curve over all the step's tokens: prompt_feature's own column)
        many = getattr(model, "prompt_s_many", None)
        table = many if many is not None and many(8.0, 0.0) is not None else None
        if keep_shape:
            self._prompt_table = table
        if self._shape is not None:
            self._shape_prior(model, max_k)
        else:  # pseudo-steps; no curve of the profile's kept: prompt tokens ride on the curve
            n = np.unique(np.geomspace(1, max_tokens, 24).astype(int)).astype(float)
            none = np.zeros(n.size)
            for ctx in (0.0, 256.0 * 64, 2048.0 * 128):
                t0 = model.predict(n, ctx, np.zeros(max_k), 0.0, none, none, ctx / 64) - overhead
                self.verify.seed(verify_features(n, ctx), t0, weight)
            p = np.unique(np.geomspace(8, max(max_tokens // 2, 8), 10).astype(int)).astype(float)
            for d in (1.0, 8.0, 32.0):
                t = np.asarray(model.predict(d + p, 0.0, np.zeros(max_k), 0.0, np.zeros(p.size), np.zeros(p.size),
                                             0.0), dtype=float)
                self.verify.seed(verify_features(d + p, 0.0), t - overhead, weight)
        self.other_s, self._other_w = overhead, 1.0  # one pseudo-step: the first real ones replace it
        b = np.unique(np.geomspace(1, 256, 10).astype(int)).astype(float)
        one = np.ones(b.size)
        zero = np.zeros(b.size)
        for k in (1, 4, max_k):
            t = np.array([model.predict(one[:1], 0.0, np.zeros(max_k), nb, np.array([float(k)]), zero[:1], 0.0)[0]
                          - model.predict(one[:1], 0.0, np.zeros(max_k), nb, zero[:1], zero[:1], 0.0)[0] for nb in b])
            self.draft.seed(draft_features(np.full(b.size, float(k)), b * k, zero, 0.0), t, weight)
        self._refresh()

    def _shape_prior(self, model: StepCostModel, max_k: int) -> None:
        """The verify fit's prior with the profile's curve kept: that curve as it is (a constant of
        0, the curve's coefficient 1), drafted rows at the curve's price (0 more), the profile's
        context term and its prompt chunks (coefficient 1). Each coefficient is worth a number of
        steps (``SHAPE_PRIOR_STEPS``) at its column's typical size.

        Why a prior on the coefficients and not pseudo-steps from the profile: pseudo-steps over
        1-4096 tokens and contexts up to 262,144 tokens held the curve's coefficient and the
        context's at the profile's by their leverage, so live steps that visit a few token counts
        moved only the constant: a machine 1.3x slower kept the profile's step at 9 tokens, and a
        load's steps priced the counts just below the ones it visits (a closed loop's steps while
        a prompt prefills) off by 10%. The constant is held firmest: where the live steps sit at
        one count, their level moves the curve's scale."""
        z = np.zeros(max_k)
        one, nil = np.ones(1), np.zeros(1)
        c = 256.0 * 64
        ctx = float(model.predict(one, c, z, 0.0, nil, nil, 64.0)[0]
                    - model.predict(one, 0.0, z, 0.0, nil, nil, 64.0)[0])
        ref = float(np.interp(16.0, *self._shape))
        # drafted rows: what four of them add to a step of four requests (their column's values are
        # that small; at the curve's own size the prior outweighed a load's worth of steps)
        rows = float(np.interp(8.0, *self._shape) - np.interp(4.0, *self._shape))
        pf = float(self.prompt_feature(8.0, 64.0))
        n = SHAPE_PRIOR_STEPS
        theta0 = [0.0, 1.0] + [0.0] * self.composition + [max(ctx, 0.0) / c / _CTX, 1.0]
        prec = [n["constant"], n["curve"] * ref ** 2] + [n["drafted"] * rows ** 2] * self.composition + \
            [n["context"] * (1024 * _CTX) ** 2, n["prompt"] * pf ** 2]
        self.verify.set_prior(np.array(prec) + self.prior_weight, np.array(theta0))

    def observe(self, step: StepOutcome, draft_batch: np.ndarray, ngram_requests: int, mean_context: float) -> None:
        """draft_batch: [K] requests drafting with the draft model at each position."""
        # With a profile's curve, the curve is of the decode and verification tokens and a step's
        # prompt chunks add a term of their own: prompt tokens do not cost what verified ones do
        # (a CPU's prompt passes are cheaper a token), and one curve over all of a step's tokens,
        # fitted to the steps with chunks too, lost the profile's steps and mispriced the tokens
        # a class's speculation adds (issue #25). Without a profile's curve to price them by, a
        # chunk's tokens stay on the one curve: right where the curve is smooth where chunks fall
        # (a GPU's, flat and then linear).
        chunked = self._shape is not None and step.num_prefill > 0
        n = float(step.verify_tokens - step.num_prefill) if chunked else float(step.verify_tokens)
        drafted = 0.0
        if self._shape is None:
            xv = [1.0, n * _TOK] + [max(n - kt, 0.0) * _TOK for kt in VERIFY_KNOTS]
        else:
            xv = [1.0, float(np.interp(n, *self._shape))]
            # The tokens beyond one a decoding request have a column of their own: a drafted row can
            # cost what a request's first does not (through Ray Serve on an AVX2 CPU the steps with
            # drafted tokens ran 22-29% over the calibration, plain ones 7-23%), and where a load's
            # steps visit a few token counts, one curve priced the drafted rows from the plain ones.
            # The decoding requests: the context over the mean context a request (what the planner
            # passes too); unknown (no context): nothing counted as drafted.
            if self.composition:
                drafted = float(self._drafted(n, step.context_tokens, mean_context))
                xv.append(drafted)
        xv.append(step.context_tokens * _CTX)
        xv.append(float(self.prompt_feature(n, step.num_prefill)) if chunked else 0.0)
        self.verify.update(np.array(xv), step.verify_s)
        if self._local is not None:
            self._local_observe(n, step, drafted)
        tokens = float(draft_batch.sum())
        xd = [float(np.count_nonzero(draft_batch)), tokens * _TOK, tokens * mean_context * _CTX, ngram_requests * _TOK]
        self.draft.update(np.array(xd), step.draft_s)
        g = self.discount
        self._other_w = g * self._other_w + 1.0
        self.other_s += (step.other_s - self.other_s) / self._other_w
        self.prefill_s += (step.prefill_s - self.prefill_s) / self._other_w
        self.steps += 1
        if self.steps % 4 == 0 or self.steps < 32:  # refit every 4 steps once warm
            self._stale = True

    def _local_observe(self, n: float, step: StepOutcome, drafted: float) -> None:
        """A step without prompt chunks into the local correction's point nearest its decode
        tokens (``drafted``: its drafted tokens' column, whose part the fit prices apart). Steps
        with chunks stay out: what they took beyond the decode rows' curve is the chunks' price
        as much as the curve's, and through them the fewer decode rows (a closed loop's steps
        while a client's next prompt prefills) would be charged for it."""
        self._local *= self.discount
        if step.num_prefill > 0 or n < 1:
            return
        xs = self._xs
        i = int(np.searchsorted(xs, n))
        if i >= xs.size or (i > 0 and np.log(n / max(xs[i - 1], 0.5)) < np.log(xs[i] / n)):
            i -= 1
        self._local[:, i] += (1.0, step.verify_s, step.context_tokens, n, drafted)

    def _local_fit(self, ys: np.ndarray) -> np.ndarray:
        """The fitted curve ``ys`` (at _xs) times a local correction: at each point, the ratio of
        what the steps there took (less the context's part) to what the fit prices them, averaged
        over the neighbouring points by the kernel and pulled to 1 by ``local_pseudo`` steps.

        Why: the fit's curve is the profile's, scaled and offset, and a live path's steps need not
        keep its shape (another machine's blocks of rows, the host's share of a step); a few
        coefficients fitted to the counts a load visits leave those counts off by what the shape
        misses. The ratio corrects the counts the steps visit and leaves the profile's shape
        wherever live steps are sparse."""
        m = self._local[0] > 1e-6
        if not m.any() or np.isinf(self.local_pseudo):
            return ys
        wm, verify, ctx, n, drafted = self._local[:, m]
        n = n / wm
        level = (verify - self._ctx_coef * ctx - self._drafted_coef * drafted) / wm
        fit = np.interp(n, self._xs, ys)
        ratio = np.clip(level / np.maximum(fit, 1e-9), 0.25, 4.0)
        k = self._lk[:, m]
        corr = (k @ (wm * ratio) + self.local_pseudo) / (k @ wm + self.local_pseudo)
        return ys * corr

    def _refresh(self) -> None:
        """Turn the fitted coefficients into an interpolation table (cheap to evaluate)."""
        v = self.verify.coef()
        self._ctx_coef = v[-2] * _CTX
        self.prompt_coef = float(v[-1])
        nb = self._basis.shape[1]
        self._ys = self._basis @ v[:nb]
        self._drafted_coef = float(v[nb]) if v.size > nb + 2 else 0.0
        if self._local is not None:
            self._ys = self._local_fit(self._ys)
        if self._drafted_coef:
            self._ys_d = self._ys + self._drafted_coef * np.interp(self._xs, *self._shape)
        self._dl = [float(x) for x in self.draft.coef()]
        self._stale = False

    batched = True  # predict takes [C, ...] rows (see StepCostModel)

    def prompt_feature(self, decode_tokens, prompt_tokens):
        """The prompt chunks' column for steps of ``decode_tokens`` with ``prompt_tokens`` of chunks
        (any shapes that broadcast), with a profile's curve kept (see ``observe``): what the
        seeding profile charges them (its prompt table, or its verify curve from the decode
        tokens to all the step's tokens). Its coefficient scales it to the live steps."""
        d = np.asarray(decode_tokens, dtype=float)
        p = np.asarray(prompt_tokens, dtype=float)
        if self._prompt_table is not None:
            return self._prompt_table(p, d)
        return np.interp(d + p, *self._shape) - np.interp(d, *self._shape)

    def chunk_s(self, verify_tokens, chunk_tokens):
        """Seconds a prompt chunk of ``chunk_tokens`` adds to a step of ``verify_tokens`` decode
        and verification tokens (any shape), as learned from the steps that carried chunks; None
        without a profile's curve (the chunk is then priced on the curve, see ``observe``)."""
        if self._shape is None:
            return None
        if self._stale:
            self._refresh()
        return self.prompt_coef * self.prompt_feature(verify_tokens, chunk_tokens)

    def step_time(self, verify_tokens, context_tokens, draft_batch, ngram_requests, mean_context):
        """Seconds of a step of a given composition (``StepCostModel.step_time``)."""
        if self._stale:
            self._refresh()
        d0, d1, d2, d3 = self._dl
        D = np.asarray(draft_batch, dtype=float)
        forwards = np.minimum(D, 1.0).sum(axis=-1)  # a position drafted by under one request: that share
        tokens = D.sum(axis=-1)
        table, drafted = self._with_drafted(verify_tokens, context_tokens, mean_context)
        t = _interp(verify_tokens, self._xs, table) + drafted
        t = t + self._ctx_coef * np.asarray(context_tokens, dtype=float) + self.other_s
        t = t + d0 * forwards + (d1 + d2 * np.asarray(mean_context, dtype=float) * _TOK) * _TOK * tokens
        t = t + (d3 * _TOK) * np.asarray(ngram_requests, dtype=float)
        return np.maximum(t, 1e-6)

    def _with_drafted(self, verify_tokens, context_tokens, mean_context):
        """(the curve table to price the verify tokens on, what to add): with the drafted rows'
        column, the planner's hot path. The coefficient times the profile's curve at the verify
        tokens is folded into a table of its own (one interpolation over the candidates, not three),
        less it at the requests, which are one a class row; exact wherever the verify tokens are at
        least the requests (every step's are). Requests unknown (no context): nothing drafted."""
        if not self._drafted_coef:
            return self._ys, 0.0
        m = np.asarray(mean_context, dtype=float)
        if not np.all(m > 0):
            return self._ys, self._drafted_coef * self._drafted(verify_tokens, context_tokens, mean_context)
        req = np.asarray(context_tokens, dtype=float) / m
        return self._ys_d, -self._drafted_coef * _interp(req, *self._shape)

    def _drafted(self, verify_tokens, context_tokens, mean_context):
        """What the profile's curve charges a step's rows beyond one a decoding request (the
        requests: the context over the mean context); 0 where that is unknown (no context)."""
        m = np.asarray(mean_context, dtype=float)
        v = np.asarray(verify_tokens, dtype=float)
        req = np.where(m > 0, np.asarray(context_tokens, dtype=float) / np.maximum(m, 1e-9), v)
        return np.maximum(_interp(v, *self._shape) - _interp(np.minimum(req, v), *self._shape), 0.0)

    def predict(self, verify_tokens, context_tokens, draft_other, n_class, k_draft, ngram_requests, mean_context,
                draft_depth=None):
        if self._stale:
            self._refresh()
        d0, d1, d2, d3 = self._dl
        # the others' deepest draft forward
        other_fwd = np.count_nonzero(draft_other, axis=-1) if draft_depth is None else draft_depth
        key = (id(k_draft), other_fwd.tobytes() if isinstance(other_fwd, np.ndarray) else int(other_fwd))
        forwards = self._fwd.get(key)
        if forwards is None:  # draft forwards per candidate: its k or the others' deepest
            forwards = self._fwd[key] = np.maximum(k_draft, np.asarray(other_fwd)[..., None]).astype(float)
            self._fwd_keep.append(k_draft)
        per_token = (d1 + d2 * mean_context * _TOK) * _TOK
        # [C, 1] (or [1] for one class): the part every candidate of a class shares
        const = self._ctx_coef * context_tokens + self.other_s + per_token * np.add.reduce(draft_other, axis=-1,
                                                                                           keepdims=True)
        table, drafted = self._with_drafted(verify_tokens, context_tokens, mean_context)
        t = _interp(verify_tokens, self._xs, table)
        t += drafted
        t += d0 * forwards
        t += (per_token * n_class) * k_draft
        t += (d3 * _TOK) * ngram_requests
        t += const
        return np.maximum(t, 1e-6, out=t)
