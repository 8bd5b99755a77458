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
    """[A] decode and verification tokens -> [A, 2 + len(VERIFY_KNOTS) (+ 1 with ``shape``) + 2]
    design matrix: the curve's columns, then the context's and the prompt chunks' (``prompt``:
    their feature, ``OnlineStepCost.prompt_feature``). ``shape``: a prior's verify curve (tokens,
    seconds), one more column, its value."""
    n = np.asarray(verify_tokens, dtype=float)
    cols = [np.ones_like(n), n * _TOK]
    cols += [np.maximum(n - kt, 0.0) * _TOK for kt in VERIFY_KNOTS]
    if shape is not None:
        cols.append(np.interp(n, *shape))
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

    verify_s ~ piecewise-linear(tokens) [+ a * the prior's verify curve] + c * context_tokens
               [+ p * the prior's price of the step's prompt chunks];
    with a prior's curve (``seed_from``) the curve is over the decode and verification tokens and
    the chunks have their own term (``prompt_feature``, ``chunk_s``); without one, over all tokens;
    draft_s ~ d0 * forwards + d1 * drafted tokens + d2 * drafted tokens * context + g * n-gram requests;
    other_s ~ discounted mean. Optionally seeded from a profile (``seed_from``).

    A prefill pass of its own (``StepOutcome.prefill_s``, the live engine's) is not part of a
    prediction: the arms do not change it. ``prefill_s`` keeps its discounted mean per step,
    which the planner adds to the step time it holds against latency targets.
    """

    discount: float = 0.998
    prior_weight: float = 1e-6
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
    _fwd: dict = field(init=False, default_factory=dict)
    _fwd_keep: list = field(init=False, default_factory=list)  # keeps cached arrays' ids valid

    def __post_init__(self) -> None:
        dv = 4 + len(VERIFY_KNOTS)
        self.verify = _DiscountedRidge(dv, self.discount, self.prior_weight, np.zeros(dv))
        self.draft = _DiscountedRidge(4, self.discount, self.prior_weight, np.zeros(4))

    def seed_from(self, model: StepCostModel, *, max_tokens: int = 4096, max_k: int = 8, weight: float = 0.05,
                  keep_shape: bool = True) -> None:
        """Seed the prior with pseudo-steps predicted by ``model`` (e.g. a profile);
        ``keep_shape``: its verify curve also becomes a column of the fit (see below)."""
        n = np.unique(np.geomspace(1, max_tokens, 24).astype(int)).astype(float)
        none = np.zeros(n.size)
        # the profile's fixed per-step overhead is the "other" part here, learned on its own:
        # seeded there, not into the verify curve (predict adds other_s to it)
        overhead = float(getattr(model, "step_overhead_s", 0.0))
        # The profile's verify curve itself becomes a column of the fit, so the learned curve keeps
        # its steps: a CPU's matrix kernels work in blocks of rows, and the pass over 9 tokens took
        # 28% longer than over 8 (SmolLM2 fp32, AVX2), where the hinges at 8, 16, ... spread such a
        # step over the segment and priced one more request's token at 20 times its cost. The live
        # steps then fit its scale (another machine's profile: a slower or faster copy of it).
        if keep_shape and self.steps == 0 and self._shape is None:
            grid = np.unique(np.concatenate([np.arange(1.0, 65.0), np.geomspace(64, max_tokens, 24).round()]))
            empty = np.zeros(grid.size)
            curve = model.predict(grid, 0.0, np.zeros(max_k), 0.0, empty, empty, 0.0) - overhead
            self._shape = (grid, np.asarray(curve, dtype=float))
            # the curve bends at the knots and at the profile's points: evaluate it at all of them
            self._xs = np.union1d(_XS, grid)
            self._basis = verify_features(self._xs, 0.0, self._shape)[:, :-2]
            dv = 5 + len(VERIFY_KNOTS)
            self.verify = _DiscountedRidge(dv, self.discount, self.prior_weight, np.zeros(dv))
        for ctx in (0.0, 256.0 * 64, 2048.0 * 128):
            t0 = model.predict(n, ctx, np.zeros(max_k), 0.0, none, none, ctx / 64) - overhead
            self.verify.seed(verify_features(n, ctx, self._shape), t0, weight)
        # steps with a prompt chunk: the model's price of them (its prompt table where it has one,
        # else its verify curve over all the step's tokens: prompt_feature's own column)
        many = getattr(model, "prompt_s_many", None)
        table = many if many is not None and many(8.0, 0.0) is not None else None
        if keep_shape:
            self._prompt_table = table
        p = np.unique(np.geomspace(8, max(max_tokens // 2, 8), 10).astype(int)).astype(float)
        for d in (1.0, 8.0, 32.0):
            base = float(model.predict(np.array([d]), 0.0, np.zeros(max_k), 0.0, none[:1], none[:1], 0.0)[0])
            if table is not None and self._shape is not None:
                t = base + table(p, d)
            else:
                t = np.asarray(model.predict(d + p, 0.0, np.zeros(max_k), 0.0, np.zeros(p.size), np.zeros(p.size),
                                             0.0), dtype=float)
            if self._shape is None:  # no curve of the profile's kept: prompt tokens ride on the curve
                X = verify_features(d + p, 0.0)
            else:
                X = np.stack([verify_features(np.array([d]), 0.0, self._shape, self.prompt_feature(d, x))[0]
                              for x in p])
            self.verify.seed(X, t - overhead, weight)
        self.other_s, self._other_w = overhead, 1.0  # one pseudo-step: the first real ones replace it
        b = np.unique(np.geomspace(1, 256, 10).astype(int)).astype(float)
        one = np.ones(b.size)
        zero = np.zeros(b.size)
        for k in (1, 4, max_k):
            t = np.array([model.predict(one[:1], 0.0, np.zeros(max_k), nb, np.array([float(k)]), zero[:1], 0.0)[0]
                          - model.predict(one[:1], 0.0, np.zeros(max_k), nb, zero[:1], zero[:1], 0.0)[0] for nb in b])
            self.draft.seed(draft_features(np.full(b.size, float(k)), b * k, zero, 0.0), t, weight)
        self._refresh()

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
        xv = [1.0, n * _TOK] + [max(n - kt, 0.0) * _TOK for kt in VERIFY_KNOTS]
        if self._shape is not None:
            xv.append(float(np.interp(n, *self._shape)))
        xv.append(step.context_tokens * _CTX)
        xv.append(float(self.prompt_feature(n, step.num_prefill)) if chunked else 0.0)
        self.verify.update(np.array(xv), step.verify_s)
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

    def _refresh(self) -> None:
        """Turn the fitted coefficients into an interpolation table (cheap to evaluate)."""
        v = self.verify.coef()
        self._ys = self._basis @ v[:-2]
        self._ctx_coef = v[-2] * _CTX
        self.prompt_coef = float(v[-1])
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
        t = _interp(verify_tokens, self._xs, self._ys)
        t = t + self._ctx_coef * np.asarray(context_tokens, dtype=float) + self.other_s
        t = t + d0 * forwards + (d1 + d2 * np.asarray(mean_context, dtype=float) * _TOK) * _TOK * tokens
        t = t + (d3 * _TOK) * np.asarray(ngram_requests, dtype=float)
        return np.maximum(t, 1e-6)

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
        t = _interp(verify_tokens, self._xs, self._ys)
        t += d0 * forwards
        t += (per_token * n_class) * k_draft
        t += (d3 * _TOK) * ngram_requests
        t += const
        return np.maximum(t, 1e-6, out=t)
