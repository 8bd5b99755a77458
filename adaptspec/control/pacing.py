"""TPOT-paced prefill: cap a step's prompt chunks so the classes with a TPOT target keep it.

Chunked prefill bounds how long one prompt holds the running requests, but not how often:
a burst of long prompts fills step after step with chunks up to the token budget, and a
request with a tight TPOT target that lives through the burst misses it, whatever arm it
runs (simulations/REPORT.md, interactive + batch at high load). The prompt work per second
is set by the arrivals, not by the scheduler; what the scheduler chooses is when it runs. A
class with a generous TTFT target (a batch class) can wait a few seconds for its first token;
a request of a TPOT class cannot get back time lost mid-answer. So, each step:

- the step's time budget is ``margin x`` the tightest of ``tpot_s[c] x`` (tokens a request of
  class c emits per step, measured) over the TPOT classes decoding in it;
- the prompt chunks get the tokens that fit in what the decode and verification rows leave
  of it, priced by a step-time fit measured on the replica's own steps
  (``wall ~ a + b * decode tokens + c * prompt tokens``, discounted least squares);
- but never fewer than the waiting prompts need to reach their first token within ``slack x``
  their class's TTFT target (the tokens ahead of each, over the time it has left), and no cap
  at all once a waiting request is within one step of that deadline.

Until the fit has seen enough steps with prompt chunks, or when no TPOT class is decoding,
the step keeps the scheduler's whole budget. Pacing only moves prompt work between steps:
what any request's tokens are does not change (greedy outputs are identical with and
without it).

Ray-free and engine-free: the simulator's replica and the engine's scheduler use it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np


@dataclass(slots=True)
class PrefillPacer:
    tpot_s: dict[str, float]  # request class -> TPOT target (classes absent: not paced for)
    ttft_s: dict[str, float]  # request class -> TTFT target (the prompt work's deadlines); absent: none
    margin: float = 0.9  # the step budget's share of the TPOT target
    slack: float = 0.8  # a waiting prompt's deadline: this share of its class's TTFT target
    min_chunk: int = 64  # prompt tokens a step may always carry (the backlog keeps moving)
    half_life_steps: float = 200.0  # steps over which the step-time fit and the tokens per step forget
    min_prompt_steps: float = 8.0  # (discounted) steps with prompt chunks before the fit is used
    rate_floor: float = 1.1  # a step's prompt tokens are at least this x the rate prefilled lately
    _xx: np.ndarray = field(init=False)  # discounted sum of x x^T, x = (1, decode tokens, prompt tokens)
    _xy: np.ndarray = field(init=False)  # ... of x * wall
    _prompt_steps: float = field(init=False, default=0.0)
    _prompt_tok: float = field(init=False, default=0.0)  # discounted prompt tokens processed
    _prompt_wall: float = field(init=False, default=0.0)  # ... over these seconds of steps
    _coef: tuple[float, float, float] | None = field(init=False, default=None)
    _tokens: dict[str, list[float]] = field(init=False, default_factory=dict)  # class -> [emitted, request-steps]
    paced_steps: int = field(init=False, default=0)  # steps whose prompt tokens the pacer cut

    def __post_init__(self) -> None:
        for name, v in (("margin", self.margin), ("slack", self.slack), ("half_life_steps", self.half_life_steps)):
            if not v > 0:
                raise ValueError(f"{name}: must be > 0, got {v}")
        if self.rate_floor < 0:
            raise ValueError(f"rate_floor: must be >= 0, got {self.rate_floor}")
        if self.min_chunk < 0:
            raise ValueError(f"min_chunk: must be >= 0, got {self.min_chunk}")
        for what, d in (("tpot_s", self.tpot_s), ("ttft_s", self.ttft_s)):
            for c, t in d.items():
                if not t > 0:
                    raise ValueError(f"{what}[{c!r}]: must be > 0, got {t}")
        self._xx = np.zeros((3, 3))
        self._xy = np.zeros(3)

    # ---- what a step teaches ----------------------------------------------------------
    def observe(self, wall_s: float, decode_tokens: int, prompt_tokens: int,
                emitted: Mapping[str, tuple[int, int]]) -> None:
        """One step: its seconds, its decode and verification tokens, its prompt tokens, and
        per class (tokens emitted, requests decoding)."""
        if wall_s <= 0 or decode_tokens + prompt_tokens <= 0:
            return
        g = 0.5 ** (1.0 / self.half_life_steps)
        x = np.array((1.0, decode_tokens, prompt_tokens), dtype=float)
        self._xx = g * self._xx + np.outer(x, x)
        self._xy = g * self._xy + x * wall_s
        self._prompt_steps = g * self._prompt_steps + (1.0 if prompt_tokens > 0 else 0.0)
        self._prompt_tok = g * self._prompt_tok + prompt_tokens
        self._prompt_wall = g * self._prompt_wall + wall_s
        self._coef = None
        for c, (tok, n) in emitted.items():
            if n <= 0 or c not in self.tpot_s:
                continue
            acc = self._tokens.setdefault(c, [0.0, 0.0])
            acc[0] = g * acc[0] + tok
            acc[1] = g * acc[1] + n

    def tokens_per_step(self, request_class: str) -> float:
        """Tokens a request of the class emitted per step it decoded in, lately (1 until seen)."""
        acc = self._tokens.get(request_class)
        return acc[0] / acc[1] if acc and acc[1] > 0 else 1.0

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c) of wall ~ a + b * decode tokens + c * prompt tokens; None until enough steps
        with prompt chunks were seen, or when the fit does not price a prompt token above 0."""
        if self._coef is None and self._prompt_steps >= self.min_prompt_steps:
            # a small ridge, relative to each column's scale: steps whose decode tokens barely vary
            # leave that column near-singular
            ridge = np.diag(1e-9 * np.diag(self._xx) + 1e-12)
            try:
                a, b, c = np.linalg.solve(self._xx + ridge, self._xy)
            except np.linalg.LinAlgError:
                return None
            if c > 0:
                self._coef = (float(a), float(b), float(c))
        return self._coef

    def deadline(self, request_class: str, arrival_s: float) -> float:
        """When a request's first token is due (``slack`` x its class's TTFT target after it
        arrived; a class without one after every class with one). With pacing the scheduler
        serves prompt work earliest deadline first: a paced backlog of long batch prompts
        must not hold a short prompt of a class with a tight TTFT target behind it."""
        t = self.ttft_s.get(request_class)
        return arrival_s + (self.slack * t if t is not None else 1e9)

    # ---- the cap ----------------------------------------------------------------------
    def step_budget_s(self, decoding: Iterable[str]) -> float | None:
        """The step's seconds for the TPOT classes among ``decoding`` (None: none decodes;
        a class named more than once counts once)."""
        s = None
        for c in decoding:
            t = self.tpot_s.get(c)
            if t is not None:
                b = self.margin * t * self.tokens_per_step(c)
                s = b if s is None else min(s, b)
        return s

    def prompt_budget(self, decoding: Iterable[str], decode_tokens: int, waiting: Iterable[tuple[str, int, float]],
                      budget: int, blocked: bool = False) -> int:
        """Prompt tokens this step may carry, at most ``budget`` (the scheduler's).

        ``decoding``: the classes of the requests decoding in the step; ``waiting``: every
        request whose prompt is not all in, in the order the scheduler serves them, as (class,
        prompt tokens left, seconds since it arrived)."""
        if budget <= 0:
            return 0
        if blocked:  # requests wait for room the prompts held back keep: no cap
            return budget
        S = self.step_budget_s(decoding)
        coef = self.fit() if S is not None else None
        if coef is None:
            return budget
        a, b, c = coef
        t0 = a + b * decode_tokens
        cap = int(max(S - t0, 0.0) / c)
        if cap >= budget:
            return budget
        step = max(S, t0)
        # prompt tokens per second the waiting requests' deadlines ask for, and never less than
        # the replica has been prefilling: pacing spreads a burst, it must not let the backlog grow
        need = self.rate_floor * self._prompt_tok / self._prompt_wall if self._prompt_wall > 0 else 0.0
        must = 0  # the tokens through the last request within one step of its deadline: all go now
        ahead = 0
        for cls, left, waited in waiting:
            ahead += left
            target = self.ttft_s.get(cls)
            if target is None:
                continue
            t_left = self.slack * target - waited
            if t_left <= step:
                must = ahead
            else:
                need = max(need, ahead / t_left)
        out = min(budget, max(cap, must, int(need * step) + 1 if need > 0 else 0, self.min_chunk))
        if out < budget:
            self.paced_steps += 1
        return out

