"""Cost models of the simulator: step time from a profile (CPU-measured, GPU-built, user's).

Step = draft + verify + overhead, where
- verify_s = table(verify_tokens) + verify_context_s_per_token * context_tokens
  (the table holds every token-proportional part: linear layers, output layer, collectives;
  the context term is the KV cache read by attention, bytes / bandwidth);
- draft_s = sum over drafted positions j of [table_d(n_j) + draft_context_s_per_token * n_j *
  mean context] for the draft model (n_j requests still drafting at j), plus
  ngram_s_per_request per n-gram request;
- other_s = step_overhead_s + step_overhead_s_per_request * requests decoding (scheduling,
  sampling, acceptance and bookkeeping per request, host work).

Prompt tokens in a step: priced on the verify table by default. A profile with a prompt table
(``prefill_tokens`` / ``prefill_s``: a pass that prefills one request's prompt and decodes
nothing, P) prices them apart: the step's d decode and verification tokens on the verify table,
plus what p prompt rows add to a pass that already has those d rows, ``P(d + p) - P(d)`` (P
from an empty pass at 0 tokens; with no decode rows, ``P(p)`` less the empty pass). Why apart:
a verified token needs an output-layer row and the verifier's work over the whole vocabulary, a
prompt token does not (one row per finished prompt), and a one-request pass reads one KV
context where a verification step of as many tokens reads one per request; on a small model
the verify table prices a short prompt a third or more too high, and with it every TTFT. Why
on top of the d rows: a pass's first rows ride on reading the weights (nearly free on a GPU
or a CPU alike) and later rows are compute; prompt rows that join decode rows do not get
those first rows again, and a table taken from an empty pass would price them too low.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class SpeedProbeRef(BaseModel):
    """The calibration's speed probes (``adaptspec.sim.speed_probe``): median decode-step
    seconds per batch size on its engine at the calibration's start and end. Their mean is the
    reference a later probe of a live engine is divided by (its speed factor)."""

    model_config = ConfigDict(extra="forbid")

    batch_sizes: list[int] = Field(description="probed batch sizes (ascending)")
    start_s: list[float] = Field(description="seconds of a decode step at each batch size, at the start")
    end_s: list[float] = Field(description="... at the end")

    @model_validator(mode="after")
    def _check(self) -> "SpeedProbeRef":
        n = len(self.batch_sizes)
        if not n or len(self.start_s) != n or len(self.end_s) != n:
            raise ValueError("probe: needs one start_s and one end_s per batch size")
        if any(b <= a for a, b in zip(self.batch_sizes, self.batch_sizes[1:])) or self.batch_sizes[0] < 1:
            raise ValueError("probe.batch_sizes: positive and strictly ascending")
        if any(not x > 0 for x in self.start_s + self.end_s):
            raise ValueError("probe: seconds must be > 0")
        return self

    def reference(self) -> dict[int, float]:
        """{batch size: mean of the start and end probes}."""
        return {b: (s + e) / 2 for b, s, e in zip(self.batch_sizes, self.start_s, self.end_s)}


# the profile's seconds (and seconds per token/request): what a slower or faster machine scales
TIME_FIELDS = ("verify_s", "verify_context_s_per_token", "draft_s", "draft_context_s_per_token",
               "ngram_s_per_request", "step_overhead_s", "step_overhead_s_per_request", "prefill_s")


class ProfileFile(BaseModel):
    """A step-cost profile file (JSON), as ``adaptspec calibrate`` writes it."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="what was measured (machine, models, dtype)")
    verify_tokens: list[float] = Field(description="token counts of the verification pass (ascending)")
    verify_s: list[float] = Field(description="seconds of the verification pass at each token count, without context")
    verify_context_s_per_token: float = Field(0.0, ge=0, description="extra verify seconds per KV token read")
    draft_batch: list[float] = Field(default_factory=lambda: [1.0], description="batch sizes of one draft forward (ascending)")
    draft_s: list[float] = Field(default_factory=lambda: [0.0], description="seconds of one draft forward at each batch size")
    draft_context_s_per_token: float = Field(0.0, ge=0, description="extra draft seconds per KV token read")
    ngram_s_per_request: float = Field(0.0, ge=0, description="seconds of an n-gram lookup per request")
    prefill_tokens: list[float] = Field(default_factory=list, description="prompt lengths of a pass that prefills "
                                        "one request and decodes nothing (ascending; empty: prompt tokens are "
                                        "priced on the verify table)")
    prefill_s: list[float] = Field(default_factory=list, description="seconds of that pass at each prompt length "
                                   "(overhead excluded, as verify_s)")
    step_overhead_s: float = Field(0.0, ge=0, description="fixed seconds per step (host work)")
    step_overhead_s_per_request: float = Field(0.0, ge=0, description="host seconds per request decoding in the "
                                               "step, beyond step_overhead_s (sampling, acceptance, bookkeeping)")
    kv_capacity_tokens: int = Field(1_000_000, gt=0, description="KV cache capacity in tokens")
    max_num_seqs: int = Field(256, gt=0, description="most running requests")
    max_batched_tokens: int = Field(8192, gt=0, description="token budget of one step (chunked prefill)")
    calibrated: bool = Field(False, description="true when measured from the live engine")
    notes: list[str] = Field(default_factory=list, description="assumptions and provenance")
    probe: SpeedProbeRef | None = Field(None, description="the calibration's speed probes (absent in older "
                                                          "profiles)")

    def scaled(self, factor: float, prompt_factor: float | None = None) -> "ProfileFile":
        """The same profile with every time field (``TIME_FIELDS``) times ``factor``: the
        machine ``factor`` times slower (> 1) or faster; limits, token counts and notes as they
        were. ``prompt_factor``: the prompt table (``prefill_s``) times this instead (its own
        measurement, e.g. a prompt probe's)."""
        for name, f in (("factor", factor), ("prompt_factor", factor if prompt_factor is None else prompt_factor)):
            if not (math.isfinite(f) and f > 0):
                raise ValueError(f"scaled: {name} must be a positive number, got {f!r}")
        update = {}
        for name in TIME_FIELDS:
            f = prompt_factor if name == "prefill_s" and prompt_factor is not None else factor
            v = getattr(self, name)
            update[name] = [x * f for x in v] if isinstance(v, list) else v * f
        return self.model_copy(update=update)

    @model_validator(mode="after")
    def _check(self) -> "ProfileFile":
        for xs, ys, name in ((self.verify_tokens, self.verify_s, "verify"), (self.draft_batch, self.draft_s, "draft"),
                             (self.prefill_tokens, self.prefill_s, "prefill")):
            if len(xs) != len(ys) or (not xs and name != "prefill"):
                raise ValueError(f"{name}_s: needs one value per entry of the token/batch list")
            if any(b <= a for a, b in zip(xs, xs[1:])):
                raise ValueError(f"{name}: token/batch list must be strictly ascending")
            if any(y < 0 for y in ys):
                raise ValueError(f"{name}_s: times must be >= 0")
        return self


@dataclass(slots=True)
class StepTime:
    draft_s: float
    verify_s: float
    other_s: float

    @property
    def wall_s(self) -> float:
        return self.draft_s + self.verify_s + self.other_s


def _extrapolating(xs: np.ndarray, ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Append a far point on the last segment's slope so interpolation extrapolates."""
    if xs.size < 2:
        return np.array([xs[0], xs[0] + 1e7]), np.array([ys[0], ys[0]])
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    far = xs[-1] + 1e7
    return np.append(xs, far), np.append(ys, ys[-1] + slope * 1e7)


@dataclass(slots=True)
class ProfileCostModel:
    """The true step cost of a simulated replica (also the oracle's cost model)."""

    profile: ProfileFile
    # The truth priced off the profile (a scenario's ``hardware.off_profile``): the draft and verify
    # time of every step x ``scale``, and the share of the verify pass its drafted tokens add x
    # ``drafted_scale`` instead: a live path can run off its calibration by composition, which a
    # controller seeded from the calibration must learn (docs/simulator.md). 1, 1: the profile.
    scale: float = 1.0
    drafted_scale: float = 1.0
    _vx: np.ndarray = field(init=False)
    _vy: np.ndarray = field(init=False)
    _dx: np.ndarray = field(init=False)
    _dy: np.ndarray = field(init=False)
    _px: np.ndarray | None = field(init=False, default=None)
    _py: np.ndarray | None = field(init=False, default=None)
    _v1: float = field(init=False, default=0.0)  # the verify table's one-token price: an empty step
    _off: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if not (self.scale > 0 and self.drafted_scale > 0):
            raise ValueError(f"off-profile scales must be > 0, got scale={self.scale}, "
                             f"drafted_scale={self.drafted_scale}")
        self._off = self.scale != 1.0 or self.drafted_scale != 1.0
        p = self.profile
        self._vx, self._vy = _extrapolating(np.array(p.verify_tokens), np.array(p.verify_s))
        self._dx, self._dy = _extrapolating(np.array(p.draft_batch), np.array(p.draft_s))
        self._v1 = float(np.interp(1.0, self._vx, self._vy))
        if p.prefill_tokens:
            # from no prompt token (an empty step) up the table
            x0, y0 = np.array(p.prefill_tokens), np.array(p.prefill_s)
            if x0[0] > 0:
                x0, y0 = np.insert(x0, 0, 0.0), np.insert(y0, 0, min(self._v1, y0[0]))
            self._px, self._py = _extrapolating(x0, y0)

    @classmethod
    def load(cls, path: str | Path) -> "ProfileCostModel":
        try:
            return cls(ProfileFile.model_validate(json.loads(Path(path).read_text())))
        except ValidationError as e:
            raise ValueError(f"profile {path}: {e}") from None

    def save(self, path: str | Path) -> None:
        data = self.profile.model_dump()
        if data.get("probe") is None:  # a profile without probes reads as before
            data.pop("probe", None)
        Path(path).write_text(json.dumps(data, indent=1))

    def prior(self) -> "ProfileCostModel":
        """The profile itself (what a policy seeded from the calibration knows), without the
        off-profile truth."""
        return ProfileCostModel(self.profile) if self._off else self

    def _off_verify(self, v, decode_tokens, requests):
        """The off-profile price of a verify pass priced ``v`` on the profile, with
        ``decode_tokens`` decode and verification rows of ``requests`` requests (arrays broadcast)."""
        t = np.asarray(decode_tokens, dtype=float)
        plain = np.minimum(np.maximum(np.asarray(requests, dtype=float), 1.0), np.maximum(t, 1.0))
        drafted = np.interp(t, self._vx, self._vy) - np.interp(plain, self._vx, self._vy)
        return v * self.scale + (self.drafted_scale - self.scale) * np.maximum(drafted, 0.0)

    def verify_s(self, verify_tokens, context_tokens: float):
        return np.interp(verify_tokens, self._vx, self._vy) + self.profile.verify_context_s_per_token * context_tokens

    def draft_forward_s(self, batch: np.ndarray, mean_context: float) -> np.ndarray:
        """Seconds of draft forwards with ``batch`` requests each (0 where batch is 0)."""
        t = np.interp(batch, self._dx, self._dy) + self.profile.draft_context_s_per_token * batch * mean_context
        return np.where(batch > 0, t, 0.0)

    def prompt_s_many(self, prompt_tokens, decode_tokens) -> np.ndarray | None:
        """``prompt_s`` over arrays (any shapes that broadcast); None without a prompt table. The
        planner prices a grid of chunks at once; the simulator's step keeps the scalar ``prompt_s``
        (plain floats, a few microseconds less per simulated step). The two agree:
        tests/unit/test_control_basics.py."""
        if self._px is None:
            return None
        p = np.asarray(prompt_tokens, dtype=float)
        d = np.maximum(np.floor(np.asarray(decode_tokens, dtype=float)), 0.0)
        base = np.where(d > 0, np.interp(d, self._px, self._py), self._v1)
        return np.where(p > 0, np.maximum(np.interp(d + p, self._px, self._py) - base, 0.0), 0.0)

    def prompt_s(self, prompt_tokens: int, decode_tokens: int = 0) -> float:
        """Seconds ``prompt_tokens`` prompt tokens add to a step that has ``decode_tokens``
        decode and verification rows, with a prompt table (0 for none): ``P(d + p) - P(d)``."""
        if self._px is None or prompt_tokens <= 0:
            return 0.0
        d = max(int(decode_tokens), 0)
        base = float(np.interp(d, self._px, self._py)) if d else self._v1
        return max(float(np.interp(d + prompt_tokens, self._px, self._py)) - base, 0.0)

    def step(self, verify_tokens: int, context_tokens: float, draft_batch: np.ndarray, ngram_requests: int,
             mean_context: float, prompt_tokens: int = 0, requests: int = 0) -> StepTime:
        """draft_batch: [K] requests drafting with the draft model at each position.
        ``prompt_tokens``: how many of ``verify_tokens`` are prompt chunks (priced apart with
        a prompt table; on the verify table with the rest without one). ``requests``: requests
        decoding in the step (their host time)."""
        p = self.profile
        d = float(self.draft_forward_s(draft_batch, mean_context).sum()) + p.ngram_s_per_request * ngram_requests
        other = p.step_overhead_s + p.step_overhead_s_per_request * max(int(requests), 0)
        decode = max(verify_tokens - max(prompt_tokens, 0), 0)
        if self._px is None or prompt_tokens <= 0:
            v = float(self.verify_s(verify_tokens, context_tokens))
        else:
            v = float(self.verify_s(max(decode, 1), context_tokens)) + self.prompt_s(prompt_tokens, decode)
        if self._off:  # no decode rows: nothing drafted, _off_verify is v x scale
            v = float(self._off_verify(v, decode, requests))
            d *= self.scale
        return StepTime(d, v, other)

    @property
    def step_overhead_s(self) -> float:
        """The fixed host seconds every step adds (``OnlineStepCost.seed_from`` seeds it apart)."""
        return self.profile.step_overhead_s

    def step_time(self, verify_tokens, context_tokens, draft_batch, ngram_requests, mean_context):
        """``control.costmodel.StepCostModel.step_time``: any leading shape, expected draft
        batches (a position with under one request drafting costs that share of a forward)."""
        D = np.asarray(draft_batch, dtype=float)
        p = self.profile
        fwd = np.interp(np.maximum(D, 1.0), self._dx, self._dy) * np.minimum(D, 1.0)
        d = fwd.sum(axis=-1) + p.draft_context_s_per_token * D.sum(axis=-1) * mean_context
        v = self.verify_s(verify_tokens, np.asarray(context_tokens, dtype=float))
        if self._off:  # the decoding requests: the context over the mean context per request
            v = self._off_verify(v, verify_tokens, _requests(context_tokens, mean_context))
            d = d * self.scale
        return v + d + p.ngram_s_per_request * np.asarray(ngram_requests, dtype=float) + p.step_overhead_s

    # the control.costmodel.StepCostModel protocol (used by the oracle and to seed priors)
    def predict(self, verify_tokens, context_tokens, draft_other, n_class, k_draft, ngram_requests, mean_context):
        K = max(draft_other.size, int(np.max(k_draft, initial=0)))
        other = np.zeros(K)
        other[: draft_other.size] = draft_other
        batch = other[None, :] + n_class * (np.arange(K)[None, :] < np.asarray(k_draft)[:, None])
        d = self.draft_forward_s(batch, mean_context).sum(axis=1)
        v = self.verify_s(verify_tokens, context_tokens)
        if self._off:
            v = self._off_verify(v, verify_tokens, _requests(context_tokens, mean_context))
            d = d * self.scale
        return v + d + self.profile.ngram_s_per_request * np.asarray(ngram_requests) + self.profile.step_overhead_s


def _requests(context_tokens, mean_context):
    """The decoding requests a step's context stands for (the planner passes both, not the count)."""
    m = np.asarray(mean_context, dtype=float)
    return np.where(m > 0, np.asarray(context_tokens, dtype=float) / np.maximum(m, 1e-9), 1.0)

