"""The arm table, the batch picture a policy keeps, and the planner that picks every
class's arm at once for the goodput of the queue the arms build.

Why jointly and through the queue: a class's arm changes the step time of everyone, and
the step time decides how fast requests leave, hence how many requests a step carries,
hence the step time again. Judging an arm by the goodput of the batch as it is now (the
planner before 2026-12-02) let a class with a TPOT target push a throughput class onto no
speculation to shorten the current step; the throughput class then drained at half the
speed, the batch grew, every step got longer, and the TPOT class missed anyway, where a
plain static arm kept it (issue #25; ``tests/unit/test_control_planner.py``).

The planner models the steady state each joint assignment reaches (a fluid queue). With
``w_c`` the tokens per second class c asks for, an arm with accepted length ``L_c`` keeps
``N_c = w_c T / L_c`` of its requests in every step of length ``T`` (Little's law); the
step carries their verify tokens, draft forwards and context, plus the prompt tokens
arriving meanwhile (``P T``), and its length follows from the step-cost model. Scaling the
demand by ``theta`` scales all of it: with ``u = theta T`` the step composition is
proportional to ``u``, so one cost evaluation over a grid of ``u`` gives, for every
candidate assignment, the load ``theta(u) = u / T(u)`` it sustains at each step length.
An assignment is feasible at a load when some step length serves it (theta reaches it,
through any dip of the curve: see ``_capacity``), every TPOT class's budget holds (``T / L_c <= margin * target``), and the step
fits the replica (``sum N_c <= max_num_seqs``, verify + prefill tokens <= the step's
token budget). Its capacity ``theta*`` is the highest feasible load.

Objective (the scenario's goodput: requests meeting every SLO, TTFT included): first the
credit, each class's demand times the load it is served at within its TPOT target, counting
capacity up to ``headroom`` times today's demand as reserve at a quarter of the weight (TTFT
waits grow without bound as theta* nears 1, and Poisson arrivals need slack, but a request
served within its TPOT target is worth more than reserve) and falling steeply for a class whose target fails
at the operating load; among assignments within 1% of the best credit (under light load, all
that keep the targets), the most tokens per second from the batch as it is now, which is the
throughput of a closed loop of clients and the same goodput for open arrivals. Its step time is
the mean over the compositions a step of that batch takes (``_step_spread``), not the time of
the mean composition: where the step-cost curve bends over a few requests' tokens, a plan whose
steps vary more in size costs more than its mean step. While requests
wait for admission the demand seen is what was served, not what arrived, so the replica runs
at its capacity: the credit is each class's share of it. A class whose TPOT target no
assignment meets even alone drops out of the constraints (it misses whatever the others do).
Capacities are read relative to the batch seen (``Planner.calibration``). Then the TPOT
classes' own arms are searched again with their TPOT in a step of the batch as it is now
counted too (``_pick``'s ``now``): the steady state is where the queue goes, the present batch
is what the requests decoding now get, and through a burst only the second misses the target.

Assignments are searched by coordinate moves from the current plan: every class's every
arm with the others held, plus every arm for all classes at once, for a few rounds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from itertools import combinations
from math import comb

import numpy as np
from scipy.special import gammaln

from adaptspec.control.types import CONF_BINS, NO_SPEC, Arm, ClassTarget, StepOutcome


@dataclass(slots=True)
class ArmTable:
    """The candidate arms as arrays: index 0 is no speculation.

    Arms: for each drafter, for each confidence threshold (0 first), k = 1..max_k."""

    arms: list[Arm]
    k: np.ndarray  # [A]
    is_draft: np.ndarray  # [A] bool
    is_ngram: np.ndarray  # [A] bool: drafts by host lookup (n-gram, suffix)
    drafter_row: np.ndarray  # [A] index into the drafters list (-1: none)
    thr_row: np.ndarray  # [A] index into (0,) + thresholds
    thresholds: tuple[float, ...] = ()
    positions: dict[Arm, int] = field(default_factory=dict)

    @classmethod
    def build(cls, drafters: tuple[str, ...], max_k: int, thresholds: tuple[float, ...] = ()) -> "ArmTable":
        ds = [d for d in drafters if d != "none"]
        thr = (0.0,) + tuple(thresholds)
        arms = [NO_SPEC]
        drow, trow = [-1], [0]
        for i, d in enumerate(ds):
            for t, th in enumerate(thr):
                for k in range(1, max_k + 1):
                    arms.append(Arm(d, k, th))
                    drow.append(i)
                    trow.append(t)
        k = np.array([a.k for a in arms])
        return cls(arms, k, np.array([a.drafter == "draft" for a in arms]), np.array([a.k > 0 and a.drafter != "draft" for a in arms]),
                   np.array(drow), np.array(trow), tuple(thresholds), {a: i for i, a in enumerate(arms)})

    @property
    def threshold_bins(self) -> np.ndarray:
        """[T + 1] each threshold row's lowest kept bin (0: no threshold)."""
        return np.array([0] + [int(round(t * CONF_BINS)) for t in self.thresholds])

    def index(self, arm: Arm) -> int:
        """Position of ``arm``; an arm outside the table counts as no speculation."""
        return self.positions.get(arm, 0)

    def per_arm(self, grid: np.ndarray, none_value: float, trailing: int = 0) -> np.ndarray:
        """[..., D, T + 1, K + 1, *trailing] per (drafter, threshold, k) -> [..., A, *trailing]
        per arm (no speculation: ``none_value``)."""
        lead = grid.shape[: grid.ndim - 3 - trailing]
        tail = grid.shape[grid.ndim - trailing:] if trailing else ()
        sel = grid[(Ellipsis, self.drafter_row[1:], self.thr_row[1:], self.k[1:]) + (slice(None),) * trailing]
        first = np.full(lead + (1,) + tail, none_value, dtype=float)
        return np.concatenate([first, sel], axis=len(lead))


def check_thresholds(thresholds: tuple[float, ...], where: str = "thresholds") -> tuple[float, ...]:
    """Thresholds must be bin edges in (0, 1), ascending, unique."""
    out = []
    for t in thresholds:
        b = t * CONF_BINS
        if not 0.0 < t < 1.0 or abs(b - round(b)) > 1e-9:
            raise ValueError(f"{where}: {t} is not a multiple of {1 / CONF_BINS:g} within (0, 1)")
        out.append(round(b) / CONF_BINS)
    if sorted(set(out)) != out:
        raise ValueError(f"{where}: must be ascending and unique, got {list(thresholds)}")
    return tuple(out)


# how fast the picture forgets, in seconds of observed steps (a class's demand moves with
# arrivals: bursts of a few seconds must register, noise of single steps must not)
DEMAND_HALF_LIFE_S = 4.0
# A load shift: the batch of the last quarter half-life (time-averaged decoding requests, plus half
# a request so that a batch of 0 or 1 is no shift) this many times the picture's or less than its
# inverse. While it lasts the picture keeps a sixteenth of its half-life, so it holds the new
# load within a second or two of steps, not the several half-lives plain forgetting takes. Why: a
# picture of one client's batch, carried into a step to four clients, priced the batch at a
# quarter of its size and planned the speculation a lone request is worth for seconds after the
# change (the live loadtest's first round at a level lost 6-14% to the rounds after it, the static
# arms none; the simulator, with thompson carried from one client to four: 0.95 of a warm one in
# the first fifteen seconds).
SHIFT_RATIO = 1.5
SHIFT_SETTLED = 1.1
SHIFT_SHARE = 0.25
FILL_DISCOUNT = 0.98  # per observed group: a class's fill (candidates proposed / asked for)
FILL_PRIOR = 4.0  # candidates of "proposes all k" a class starts from (a weak prior)


@dataclass(slots=True)
class ClassSlot:
    tokens: float = 0.0  # discounted tokens emitted
    request_seconds: float = 0.0  # discounted decoding requests x step seconds
    arm: Arm = NO_SPEC  # the arm most of its requests ran in its last step
    # per drafter, discounted (candidates proposed, candidates asked for): n-gram lookup
    # proposes nothing when the context has no match, so its requests verify fewer than k + 1
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
    """What the observed steps say about demand and the batch (time-discounted)."""

    classes: dict[str, ClassSlot] = field(default_factory=dict)
    half_life_s: float = DEMAND_HALF_LIFE_S
    busy_s: float = 0.0  # discounted seconds of steps
    prefill_tokens: float = 0.0  # discounted prompt tokens processed inside steps
    prefill_chunks: float = 0.0  # discounted prompt chunks those tokens came in
    prefill_s: float = 0.0  # discounted seconds of separate prefill passes (the live engine's)
    context: float = 0.0  # discounted context tokens read by decoding requests
    request_steps: float = 0.0  # discounted decoding requests per step, summed
    request_seconds: float = 0.0  # discounted decoding requests x step seconds (time-average batch)
    _steps_w: float = 0.0  # discounted number of steps
    steps: int = 0
    version: int = 0  # bumped by every observed step
    shift_ratio: float = SHIFT_RATIO  # see SHIFT_RATIO; inf: never forget faster
    shifts: int = 0  # steps observed while a load shift held (see SHIFT_RATIO)
    _fast_busy: float = 0.0  # discounted seconds of steps, at the quarter half-life
    _fast_rs: float = 0.0  # discounted decoding requests x step seconds, at the quarter half-life
    _shifting: bool = False

    def observe(self, step: StepOutcome) -> None:
        self.version += 1
        self.steps += 1
        g = 0.5 ** (step.wall_s / self.half_life_s) if self.half_life_s > 0 else 0.0
        if self.half_life_s > 0 and np.isfinite(self.shift_ratio):
            fast_life = SHIFT_SHARE * self.half_life_s
            gf = 0.5 ** (step.wall_s / fast_life)
            self._fast_busy = gf * self._fast_busy + step.wall_s
            self._fast_rs = gf * self._fast_rs + sum(grp.num_requests for grp in step.groups) * step.wall_s
            if self._fast_busy >= fast_life and self.busy_s > 0:
                fast, slow = self._fast_rs / self._fast_busy + 0.5, self.request_seconds / self.busy_s + 0.5
                # until the picture is within SHIFT_SETTLED of the new load (hysteresis: it
                # approaches it from one side, and stopping at the entry ratio left it there)
                ratio = max(fast, slow) / min(fast, slow)
                self._shifting = ratio > (SHIFT_SETTLED if self._shifting else self.shift_ratio)
                if self._shifting:
                    g = gf ** 4  # a quarter of the fast picture's memory: at its own, it trailed it
                    self.shifts += 1
        self.busy_s = g * self.busy_s + step.wall_s
        self.prefill_tokens = g * self.prefill_tokens + step.num_prefill
        self.prefill_chunks = g * self.prefill_chunks + step.prefill_chunks
        self.prefill_s = g * self.prefill_s + step.prefill_s
        n_dec = 0
        for slot in self.classes.values():
            slot.tokens *= g
            slot.request_seconds *= g
        best: dict[str, int] = {}
        for grp in step.groups:
            n = grp.num_requests
            n_dec += n
            slot = self.classes.get(grp.request_class)
            if slot is None:
                slot = self.classes[grp.request_class] = ClassSlot()
            slot.tokens += grp.emitted
            slot.request_seconds += n * step.wall_s
            if grp.arm.k > 0 and n > 0 and not grp.arm.min_confidence:  # a threshold's stops are no lack of matches
                slot.observe_proposed(grp.arm.drafter, grp.drafted, grp.arm.k * n)
            if n > best.get(grp.request_class, 0):
                best[grp.request_class] = n
                slot.arm = grp.arm
        self.context = g * self.context + step.context_tokens
        self.request_steps = g * self.request_steps + n_dec
        self.request_seconds = g * self.request_seconds + n_dec * step.wall_s
        self._steps_w = g * self._steps_w + 1.0

    def batch(self, request_class: str) -> float:
        """Time-average decoding requests of the class per step."""
        slot = self.classes.get(request_class)
        return slot.request_seconds / self.busy_s if slot is not None and self.busy_s > 0 else 0.0

    @property
    def prefill_per_step(self) -> float:
        """Prompt tokens processed inside a step, time-averaged."""
        return self.prefill_rate * (self.busy_s / max(self._steps_w, 1e-9)) if self._steps_w > 0 else 0.0

    def demand(self, request_class: str) -> float:
        """Tokens per second of steps the class was served (its demand while nothing queues)."""
        slot = self.classes.get(request_class)
        return slot.tokens / self.busy_s if slot is not None and self.busy_s > 0 else 0.0

    @property
    def chunk_rate(self) -> float:
        """Prompt chunks processed inside steps per second of steps."""
        return self.prefill_chunks / self.busy_s if self.busy_s > 0 else 0.0

    @property
    def chunk_tokens(self) -> float:
        """Mean prompt tokens of a chunk."""
        return self.prefill_tokens / self.prefill_chunks if self.prefill_chunks > 0 else 0.0

    @property
    def prefill_rate(self) -> float:
        """Prompt tokens processed inside steps per second of steps."""
        return self.prefill_tokens / self.busy_s if self.busy_s > 0 else 0.0

    @property
    def prefill_share(self) -> float:
        """Share of step time spent in separate prefill passes (0 in the simulator)."""
        return min(self.prefill_s / self.busy_s, 0.9) if self.busy_s > 0 else 0.0

    @property
    def in_system(self) -> float:
        """Time-average decoding requests per step (Little's N of the decode phase)."""
        return self.request_seconds / self.busy_s if self.busy_s > 0 else 0.0

    @property
    def context_per_request(self) -> float:
        return self.context / self.request_steps if self.request_steps > 0 else 0.0


@dataclass(slots=True)
class ClassCurves:
    """What the classes' arms do, per class and arm of the table."""

    lengths: np.ndarray  # [C, A] expected accepted length (tokens emitted per request-step)
    tpot_lengths: np.ndarray  # [C, A] the accepted length each class's TPOT target is budgeted with
    verify: np.ndarray  # [C, A] verify tokens per request-step (1 + candidates proposed)
    reach: np.ndarray  # [C, A, K] chance the draft forward at position j runs for a request
    usable: np.ndarray  # [C, A] bool: arms the policy may pick


@dataclass(slots=True)
class PlanInputs:
    classes: list[str]
    curves: ClassCurves
    demand: np.ndarray  # [C] tokens per second
    prefill_rate: float  # prompt tokens per second inside steps
    prefill_share: float  # share of time in separate prefill passes
    context_per_request: float
    backlog: bool  # requests wait for admission
    in_system: float = 0.0  # decoding requests seen per step under the plan in force (0: unknown)
    batch: np.ndarray | None = None  # [C] decoding requests of each class seen per step (None: unknown)
    prefill_per_step: float = 0.0  # prompt tokens a step carries, as seen
    chunk_rate: float = 0.0  # prompt chunks per second inside steps (0: prompt tokens spread evenly)
    chunk_tokens: float = 0.0  # mean tokens of a chunk
    # the calibration to use instead of one read from the batch seen (``Planner.calibration``):
    # the policy passes the last one read while the batch seen is still the previous plan's
    scale: float | None = None


@dataclass(slots=True)
class PlanScore:
    capacity: np.ndarray  # [R] theta*: the highest load the assignment sustains (TPOT targets aside)
    class_capacity: np.ndarray  # [R, C] the highest load at which it also keeps each class's TPOT target
    in_system: np.ndarray  # [R] requests in the system at today's demand (inf: not sustainable)
    step_s: np.ndarray  # [R] step time at today's demand (inf: not sustainable)
    goodput: np.ndarray  # [R] tokens per second of the batch as it is now (the closed-loop view)
    theta0: np.ndarray  # [U] row 0's sustained load along the grid
    n0: np.ndarray  # [U] row 0's requests in the system along the grid
    budget: np.ndarray | None = None  # [R, C] step seconds each class's TPOT target allows (inf: none, or hopeless)
    step_now: np.ndarray | None = None  # [R] seconds of a step of the batch as it is now


GRID = np.geomspace(0.01, 1000.0, 64)  # u / (the empty step's time): loads from near idle to far past saturation
TOLERANCE = 0.01  # relative differences below this are ties (the models are not finer)


def _capacity(u: np.ndarray, T: np.ndarray, theta: np.ndarray, slack: np.ndarray):
    """[R] the largest load sustained within the limits (``slack`` >= 0), the crossing of a
    limit interpolated between grid points; and [R, U] the points up to it.

    The highest ``theta`` anywhere inside the limits, not the end of the first rising run:
    where theta dips and rises again (a step-cost table that more than doubles between two
    token counts, as one measured on a shared CPU does, makes ``u / T`` fall there), a load
    above the dip's top grows the queue through the dip to the point that serves it. The
    first rising run stopped there and priced a long arm's capacity at a fraction of a plain
    step's, so a planner with the true models chose no speculation where it paid (issue #25,
    simulations/REPORT.md). For a curve that rises, saturates and falls the two agree."""
    R, U = T.shape
    feas = np.logical_and.accumulate(slack >= 0, axis=1)
    rows = np.arange(R)
    has = feas[:, 0]
    peak = np.argmax(np.where(feas, theta, -np.inf), axis=1)  # the first highest point inside the limits
    ok = feas & (np.arange(U)[None, :] <= peak[:, None])
    cap = np.where(has, theta[rows, peak], 0.0)
    last = feas.sum(axis=1) - 1
    i = np.maximum(last, 0)
    j = np.minimum(i + 1, U - 1)
    # a limit crossed just past the peak while theta still rises: the load at the crossing
    cross = has & (peak == last) & (last < U - 1) & (theta[rows, j] > theta[rows, i]) & (slack[rows, j] < 0)
    s0, s1 = slack[rows, i], slack[rows, j]
    f = np.where(cross, s0 / np.maximum(s0 - s1, 1e-12), 0.0)
    u_x = u[i] + f * (u[j] - u[i])
    T_x = T[rows, i] + f * (T[rows, j] - T[rows, i])
    return np.where(cross, np.maximum(cap, u_x / T_x), cap), ok


SPREAD_EXACT = 128  # up to this many compositions a step's spread is enumerated; past it a quadrature
# Gauss-Hermite nodes and weights for E[f(Z)], Z standard normal (probabilists'): nine points
# follow a piecewise-linear step-cost table's bends as well as a smooth curve
_GH_Z, _GH_W = np.polynomial.hermite_e.hermegauss(9)
_GH_W = _GH_W / _GH_W.sum()


def _chunk_extra(cost, V: np.ndarray, chunk: float, T: np.ndarray, rest: tuple) -> np.ndarray:
    """Seconds a prompt chunk of ``chunk`` tokens adds to steps of ``V`` decode and verification
    tokens (``T``: those steps' seconds, ``rest``: the rest of their composition): the cost
    model's own price of a chunk where it has one (``OnlineStepCost.chunk_s``, learned from the
    steps that carried chunks), else its curve over all the step's tokens (a profile's)."""
    price = getattr(cost, "chunk_s", None)
    extra = price(V, chunk) if price is not None else None
    if extra is not None:
        return np.asarray(extra, dtype=float)
    return np.asarray(cost.step_time(V + chunk, *rest), dtype=float) - T


@lru_cache(maxsize=64)
def _integer_compositions(n: int, c: int) -> np.ndarray:
    """[M, c] every way to split ``n`` requests among ``c`` classes."""
    rows = []
    for bars in combinations(range(n + c - 1), c - 1):
        edges = (-1,) + bars + (n + c - 1,)
        rows.append([edges[i + 1] - edges[i] - 1 for i in range(c)])
    out = np.array(rows, dtype=float).reshape(-1, c)
    out.setflags(write=False)  # cached: shared by every later call
    return out


def _step_spread(nb: np.ndarray, verify: np.ndarray, reach: np.ndarray, ngram: np.ndarray):
    """The steps a batch of ``nb`` [C] mean requests per class takes, under each row's arms (each
    class's verify tokens [R, C], draft reach [R, C, K] and n-gram use [R, C] per request): verify
    tokens [R, M], requests [M], draft batch [R, M, K], n-gram requests [R, M], chances [M].

    Each request of the batch is of class c with chance nb_c / n (multinomial), and the total is
    the seen one, split between its floor and ceiling. Up to ``SPREAD_EXACT`` compositions, each
    with its chance; past that (tens of requests of several classes, where the composition is near
    normal and a class's share varies as 1 / sqrt(n)) a quadrature over the verify tokens' normal
    spread, the rest at its mean (linear in the counts, or nearly so at that size)."""
    C = nb.size
    n = float(nb.sum())
    lo = int(np.floor(n))
    frac = n - lo
    p = nb / n
    if n >= 1.0 and C > 1 and comb(lo + C, C - 1) <= SPREAD_EXACT:
        parts, chances = [], []
        for total, weight in ((lo, 1.0 - frac), (lo + 1, frac)):
            if weight > 0.0:
                k = _integer_compositions(total, C)  # [M, C]
                log_pmf = gammaln(total + 1.0) - gammaln(k + 1.0).sum(axis=1) + k @ np.log(p)
                parts.append(k)
                chances.append(weight * np.exp(log_pmf))
        k = np.concatenate(parts)
    else:
        k = nb[None, :]  # the mean composition, spread below along the verify tokens
        chances = [np.ones(1)]
    V = verify @ k.T  # [R, M]
    D = np.einsum("mc,rck->rmk", k, reach)
    G = ngram @ k.T
    prob = np.concatenate(chances)
    counts = k.sum(axis=1)
    if len(k) == 1 and C > 1 and n >= 1.0:
        var = n * ((p * verify ** 2).sum(axis=1) - ((p * verify).sum(axis=1)) ** 2)  # [R]
        V = np.maximum(V + np.sqrt(np.maximum(var, 0.0))[:, None] * _GH_Z[None, :], 0.0)  # [R, 9]
        D = np.repeat(D, len(_GH_Z), axis=1)
        G = np.repeat(G, len(_GH_Z), axis=1)
        prob = _GH_W
        counts = np.full(len(_GH_Z), n)
    return V, counts, D, G, prob


@dataclass(slots=True)
class Planner:
    table: ArmTable
    targets: dict[str, ClassTarget]
    margin: float = 0.9
    headroom: float = 1.25
    max_num_seqs: int | None = None
    max_batched_tokens: int | None = None
    rounds: int = 3
    # credit per unit of load held in reserve (above today's demand, up to ``headroom``), against
    # 1 per unit of today's demand served within target: the reserve keeps TTFT waits short,
    # but a plan that gives it up to keep a TPOT class within target serves more requests within
    # their SLOs (at full weight the reserve of a large class without a TPOT target outweighed
    # the target of a small class near the knee: issue #25)
    reserve_weight: float = 0.25
    last_capacity: float = np.inf  # capacity / demand of the last plan's choice
    last_scale: float = 1.0  # the last calibration read from the batch seen

    @property
    def tpot_power(self) -> float:
        """How fast a TPOT class's credit falls as its TPOT in a step of the batch now exceeds
        its budget (margin x target): (budget / TPOT) ** p, half where the TPOT reaches the
        target itself (about half of a class's requests miss a target its mean TPOT sits at).
        A margin of 1 leaves no room between budget and target: the default margin's p then."""
        m = self.margin if 0 < self.margin < 1 else 0.9
        return float(np.log(0.5) / np.log(m))

    def plan(self, x: PlanInputs, cost, current: np.ndarray) -> np.ndarray:
        """[C] arm indices for ``x.classes`` (``current``: the plan in force, [C])."""
        C, A = len(x.classes), len(self.table.arms)
        usable = x.curves.usable
        best = np.where(usable[np.arange(C), current], current, 0)
        scale = None
        # first every class's arm for the steady state; then the TPOT classes' own arms for their
        # TPOT in the batch as it is now too (see ``_pick``)
        phases = [(np.arange(C), False)]
        tpot = np.flatnonzero([np.isfinite(self._tpot(c)) for c in x.classes])
        if tpot.size and not x.backlog:  # while requests wait for a slot, capacity is what serves them
            phases.append((tpot, True))
        for movers, now in phases:
            if now and (score.budget[choice, movers] >= score.step_now[choice]).all():
                break  # within budget now: the credit is the steady state's, whose best this is
            M = len(movers)
            for r in range(self.rounds):
                rows = [best[None, :]]
                moves = np.repeat(best[None, :], M * A, axis=0).reshape(M, A, C)
                moves[np.arange(M), :, movers] = np.arange(A)[None, :]
                rows.append(moves.reshape(M * A, C))
                if r == 0 and not now:
                    rows.append(np.repeat(np.arange(A)[:, None], C, axis=1))
                X = np.concatenate(rows)
                ok = usable[np.arange(C)[None, :], X].all(axis=1)
                X = X[ok]
                score = self.evaluate(X, x, cost)
                if scale is None:  # row 0 is the plan in force
                    if x.backlog:
                        scale = 1.0
                    elif x.scale is not None:
                        scale = x.scale
                    elif x.in_system > 0:
                        scale = self.last_scale = self.calibration(score, x)
                    else:
                        scale = 1.0
                choice = self._pick(score, x.demand, x.backlog, scale, now)
                self.last_capacity = float(score.capacity[choice]) / scale
                if np.array_equal(X[choice], best):
                    break
                best = X[choice]
        return best

    def _pick(self, s: PlanScore, demand: np.ndarray, backlog: bool, scale: float = 1.0, now: bool = False) -> int:
        """The best row; row 0 (the plan in force) wins ties.

        First the credit: each class's demand times the load it is served at within its TPOT
        target (today's demand, with capacity up to ``headroom`` more counted as reserve at
        ``reserve_weight`` per unit; while
        requests queue, the assignment's capacity, since the replica then runs at it), falling
        as the fourth power of the shortfall for a class whose TPOT target fails there; with
        ``now``, also as (budget / TPOT) ** ``tpot_power`` where the class's TPOT in a step of
        the batch as it is now exceeds its budget.
        Among assignments within ``TOLERANCE`` of the best credit (under light load, all that
        keep the targets), the most tokens per second from the batch as it is now: where load
        is light, demand does not depend on the arms if arrivals are open (all serve it) and
        throughput is what a closed loop of clients gets, so the step's goodput decides (the
        steady state's latency would favour a class that is fast already over one that
        speculation speeds up). ``scale``: see ``calibration``."""
        w = np.maximum(demand, 1e-3 * max(float(demand.sum()), 1.0))
        cc = s.class_capacity / scale  # [R, C]
        if backlog:  # the replica runs at its capacity: each class's share of it, if its TPOT holds there
            op = (s.capacity / scale)[:, None]
            served = np.broadcast_to(op, cc.shape)
        else:  # at today's demand (1), with up to ``headroom`` more in reserve
            op = 1.0
            served = np.minimum(cc, 1.0) + self.reserve_weight * np.clip(cc - 1.0, 0.0, self.headroom - 1.0)
        # a class whose TPOT target fails at the operating load misses it for most of its
        # requests, not for the share of load above its limit: credit falls steeply
        held = np.minimum(cc / np.maximum(op, 1e-9), 1.0) ** 4
        if now and s.budget is not None and s.step_now is not None:
            # a TPOT class's own arm is also judged by its TPOT in a step of the batch as it is
            # now: the steady state is where the queue goes, the batch now is what its requests
            # get. Through a burst the steady state's TPOT holds and the present's fails, and near
            # saturation every arm's steady-state TPOT limit sits just below the capacity, so the
            # shortfall in load ranks arms by capacity, not by the TPOT their requests get: a
            # longer draft, whose extra tokens outgrow its extra step time, lost to a shorter one
            # (issue #25). Only the class's own arm: moving another class off speculation to
            # shorten the step now is the trap the steady state is there to avoid
            ratio = s.budget / s.step_now[:, None]  # [R, C] >= 1: within budget now
            now_held = np.where(np.isfinite(s.budget), np.minimum(ratio, 1.0) ** self.tpot_power, 1.0)
            held = np.minimum(held, now_held)
        credit = (w[None, :] * served * held).sum(axis=1)
        top = float(credit.max())
        near = credit >= top * (1.0 - TOLERANCE)
        g = np.where(near, s.goodput, -np.inf)
        best = float(g.max())
        return 0 if g[0] >= best * (1.0 - TOLERANCE) else int(np.argmax(g))

    def calibration(self, s: PlanScore, x: PlanInputs) -> float:
        """The load, in units of the demand seen, at which the plan in force (row 0) keeps as
        many requests in the system as were seen: capacities are then read relative to it.
        Near saturation the steady state's batch hangs on a few percent of demand (a step-time
        curve of slope 0.8 per unit load turns a 10% error in demand into 40% in the batch),
        and a demand measured over seconds of Poisson arrivals is that noisy; the batch seen is
        what the present load really does. (Scaling the demand by t scales every step's
        composition at u as at t u, so every capacity by 1 / t: no new evaluation is needed.)
        The batch seen must be the plan in force's: for a while after a change it is still the
        previous plan's, and read against the new one it gives a scale that favours going back
        (plans flipped between two assignments at every other plan near a TPOT class's limit,
        issue #25); ``PlanningPolicy`` passes the last scale read (``PlanInputs.scale``) until
        the plan has held for the picture's half-life."""
        theta, n = s.theta0, s.n0
        target = x.in_system
        if not (n[0] < target < n[-1]):
            return 1.0
        i = int(np.searchsorted(n, target))
        f = (np.log(target) - np.log(n[i - 1])) / (np.log(n[i]) - np.log(n[i - 1]))
        t = theta[i - 1] + f * (theta[i] - theta[i - 1])
        if not 0.2 < t < 5.0 or not (np.diff(theta[:i + 1]) > 0).all():
            return 1.0
        return float(t)

    def evaluate(self, X: np.ndarray, x: PlanInputs, cost) -> PlanScore:
        """Steady states of candidate joint assignments ``X`` [R, C] (see the module docstring)."""
        R, C = X.shape
        cls = np.arange(C)[None, :]
        cv = x.curves
        Lx = cv.lengths[cls, X]  # [R, C]
        Lt = cv.tpot_lengths[cls, X]
        Vx = cv.verify[cls, X]
        reach = cv.reach[cls, X]  # [R, C, K]
        ng = self.table.is_ngram[X].astype(float)
        w = np.maximum(x.demand, 1e-3 * max(float(x.demand.sum()), 1.0))  # [C] a class without traffic yet: a trickle
        a = w[None, :] / Lx  # [R, C] requests per second of u
        per_u_req = a.sum(axis=1)  # [R]
        # prompt tokens come in chunks, a prompt's (or a budget's worth of it) in one step:
        # the verify curve is flat, then steep, so a step with a chunk costs more than the
        # chunk's share of an average step (the average step's composition underprices the
        # mean step by a third or more near the knee of an H200 70B). With chunks counted,
        # decode steps carry decode tokens only and every chunk adds its own extra time
        chunked = x.chunk_rate > 0 and x.chunk_tokens > 0
        per_u_tok = (0.0 if chunked else x.prefill_rate) + (a * Vx).sum(axis=1)
        per_u_draft = (a[:, :, None] * reach).sum(axis=1)  # [R, K]
        per_u_ngram = (a * ng).sum(axis=1)
        ctx = x.context_per_request
        share = x.prefill_share
        K = reach.shape[-1]
        t0 = float(np.asarray(cost.step_time(np.zeros(1), np.zeros(1), np.zeros((1, K)), np.zeros(1), ctx))[0])
        u = t0 * GRID  # [U]
        n = per_u_req[:, None] * u[None, :]  # [R, U]
        V = per_u_tok[:, None] * u[None, :]
        D = per_u_draft[:, None, :] * u[None, :, None]
        G = per_u_ngram[:, None] * u[None, :]
        T = np.asarray(cost.step_time(V, ctx * n, D, G, ctx), dtype=float)
        if chunked:  # each chunk's extra time, x.chunk_rate per unit of theta: T += theta rate c = u rate c
            chunk = np.minimum(x.chunk_tokens, max(float(self.max_batched_tokens or np.inf), 1.0))
            extra = _chunk_extra(cost, V, chunk, T, (ctx * n, D, G, ctx))
            T = T + u[None, :] * x.chunk_rate * (x.prefill_rate / (x.chunk_rate * chunk)) * extra
            V = V + chunk  # the budget must hold a step with a chunk
        if share > 0:
            T = T / (1.0 - share)
        theta = u[None, :] / T
        # the batch as it is now (each class's requests seen per step) under each row's arms
        nb = x.batch if x.batch is not None and x.batch.sum() > 0 else w / w.sum() * max(x.in_system, 1.0)
        nb = np.maximum(nb, 1e-3)
        V_now, n_now, D_now, G_now, prob = _step_spread(nb, Vx, reach, ng)  # [R, M], [M], [R, M, K], [R, M], [M]
        V_now = V_now + (0.0 if chunked else x.prefill_per_step)
        now = (ctx * n_now[None, :], D_now, G_now, ctx)
        # the mean step over the compositions a step takes, not the step of the mean composition:
        # the verify curve bends where a few requests' tokens are added, so a plan whose steps
        # vary more in size (a class with long proposals, a step holding 0-4 of its requests)
        # costs more than its mean step's price (issue #25)
        T_dec = np.asarray(cost.step_time(V_now, *now), dtype=float)
        T_now = T_dec @ prob
        if chunked:  # time share of the chunks, at the rate seen: T_dec / (1 - rate c)
            chunk = np.minimum(x.chunk_tokens, max(float(self.max_batched_tokens or np.inf), 1.0))
            busy = x.prefill_rate / chunk * (_chunk_extra(cost, V_now, chunk, T_dec, now) @ prob)
            T_now = T_now / np.maximum(1.0 - busy, 0.05)
        if share > 0:
            T_now = T_now / (1.0 - share)
        goodput = (nb[None, :] * Lx).sum(axis=1) / T_now
        # how far each grid point is inside the replica's limits (>= 0: within them), in
        # relative units so that the tighter limit decides
        slack = np.ones_like(T)
        if self.max_num_seqs is not None:
            slack = np.minimum(slack, 1.0 - n / self.max_num_seqs)
        if self.max_batched_tokens is not None:
            slack = np.minimum(slack, 1.0 - V / self.max_batched_tokens)
        capacity, ok = _capacity(u, T, theta, slack)
        limits = np.array([self._tpot(c) for c in x.classes])  # [C] inf: no target
        class_capacity = np.repeat(capacity[:, None], C, axis=1)
        budget = np.full((R, C), np.inf)
        if np.isfinite(limits).any():
            # T / Lt_c <= margin * target for every class with a target
            budget = Lt * limits[None, :]  # [R, C] step seconds each class's TPOT allows
            tpot_slack = 1.0 - T[:, :, None] / budget[:, None, :]  # [R, U, C]
            hopeless = ~(tpot_slack[:, 0, :] >= 0).any(axis=0)  # [C] no row meets it even at idle
            budget[:, hopeless] = np.inf
            for c in np.flatnonzero(np.isfinite(limits) & ~hopeless):
                class_capacity[:, c] = _capacity(u, T, theta, np.minimum(slack, tpot_slack[:, :, c]))[0]
        # today's demand (theta = 1): interpolate u where theta crosses 1 on the feasible branch
        above = ok & (theta >= 1.0)
        has = above.any(axis=1)
        i = np.where(has, np.argmax(above, axis=1), 0)
        rows = np.arange(R)
        j = np.maximum(i - 1, 0)
        th_i, th_j = theta[rows, i], theta[rows, j]
        frac = np.where((i > 0) & (th_i > th_j), (1.0 - th_j) / np.maximum(th_i - th_j, 1e-12), 1.0)
        frac = np.clip(frac, 0.0, 1.0)
        u1 = u[j] + frac * (u[i] - u[j])
        T1 = T[rows, j] + frac * (T[rows, i] - T[rows, j])
        in_system = np.where(has, u1 * per_u_req, np.inf)
        return PlanScore(capacity, class_capacity, in_system, np.where(has, T1, np.inf), goodput, theta[0], n[0],
                         budget, T_now)

    def _tpot(self, request_class: str) -> float:
        t = self.targets.get(request_class)
        return self.margin * t.tpot_s if t is not None and t.tpot_s is not None else np.inf
