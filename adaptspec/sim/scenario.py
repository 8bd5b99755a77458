"""Scenario files (YAML), validated with pydantic; errors name the bad key."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- lengths -------------------------------------------------------------------------
class FixedLength(_Strict):
    dist: Literal["fixed"]
    value: int = Field(gt=0, description="tokens")


class UniformLength(_Strict):
    dist: Literal["uniform"]
    low: int = Field(gt=0, description="smallest, inclusive")
    high: int = Field(gt=0, description="largest, inclusive")

    @model_validator(mode="after")
    def _order(self) -> "UniformLength":
        if self.high < self.low:
            raise ValueError("high: must be >= low")
        return self


class LognormalLength(_Strict):
    dist: Literal["lognormal"]
    median: float = Field(gt=0, description="median tokens")
    sigma: float = Field(gt=0, description="standard deviation of log(tokens)")
    min: int = Field(1, gt=0, description="clip below")
    max: int = Field(32768, gt=0, description="clip above")


class ZipfLength(_Strict):
    dist: Literal["zipf"]
    a: float = Field(gt=1, description="Zipf exponent (> 1)")
    scale: int = Field(1, gt=0, description="tokens per Zipf unit")
    min: int = Field(1, gt=0, description="clip below")
    max: int = Field(32768, gt=0, description="clip above")


LengthSpec = Annotated[Union[FixedLength, UniformLength, LognormalLength, ZipfLength], Field(discriminator="dist")]


# ---- acceptance ----------------------------------------------------------------------
class ReplaySpec(_Strict):
    accepted_lengths: list[int] | None = Field(None, description="recorded accepted lengths (accepted + 1)")
    file: str | None = Field(None, description="file with one accepted length per line (relative to the scenario)")
    recorded_k: int = Field(ge=1, le=16, description="k the lengths were recorded at")

    @model_validator(mode="after")
    def _one(self) -> "ReplaySpec":
        if (self.accepted_lengths is None) == (self.file is None):
            raise ValueError("replay: give exactly one of accepted_lengths or file")
        return self


class RecordedSpec(_Strict):
    file: str = Field(description="acceptance recording JSON (adaptspec fidelity writes one), relative to the "
                                  "scenario")
    request_class: str | None = Field(None, description="class in the recording (default: this class's name)")
    drafter: Literal["ngram", "draft"] | None = Field(None, description="drafter in the recording (default: the "
                                                                        "drafter this acceptance is given for)")
    min_steps: int = Field(30, ge=1, description="replay the histogram recorded at the k asked for when it has "
                                                 "this many request-steps, else the pooled per-position rates")
    per_prompt: bool = Field(True, description="replay each request from its prompt's own counts where the "
                                               "recording has them (``workload.prompt_set`` rows in the order of "
                                               "the live run's prompt pools, as adaptspec fidelity writes them); "
                                               "false: every request from its class's")
    per_position: bool = Field(True, description="with per_prompt: replay a request's step at an output position "
                                                 "its prompt's live runs settled as it went live (the recording's "
                                                 "by_position; greedy decoding), and draw the others")


class ConfidenceSpec(_Strict):
    concentration: float = Field(gt=0, description="draft confidence at position j ~ Beta(p_j c, (1 - p_j) c) with "
                                                   "p_j the acceptance there: low c, confidences near 0 or 1 (they "
                                                   "tell accepted from rejected), high c, near p_j (they tell little)")
    calibration: list[Annotated[float, Field(ge=0, le=1)]] | None = Field(
        None, min_length=2, description="P(accepted | confidence) at the centres of equal bins of [0, 1] "
                                        "(interpolated); null: calibrated, P(accepted | c) = c")


class AcceptanceSpec(_Strict):
    bernoulli: float | None = Field(None, ge=0, lt=1, description="per-token acceptance rate")
    positions: list[Annotated[float, Field(ge=0, le=1)]] | None = Field(
        None, description="conditional acceptance per position (the last repeats)")
    replay: ReplaySpec | None = Field(None, description="accepted lengths recorded from the live engine")
    confidence: ConfidenceSpec | None = Field(None, description="the drafter reports a confidence per drafted token "
                                                                "(per-token draft stopping); null: it reports none")
    recorded: RecordedSpec | None = Field(None, description="per-k, per-position acceptance recorded from the live "
                                                            "engine, per class and drafter")

    @model_validator(mode="after")
    def _one(self) -> "AcceptanceSpec":
        given = [n for n in ("bernoulli", "positions", "replay", "recorded") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"acceptance: give exactly one of bernoulli, positions, replay, recorded "
                             f"(got {given or 'none'})")
        return self


class SLOSpec(_Strict):
    ttft_s: float | None = Field(None, gt=0, description="time to first token")
    tpot_s: float | None = Field(None, gt=0, description="time per output token after the first")
    e2e_s: float | None = Field(None, gt=0, description="end-to-end latency")


class TargetSpec(_Strict):
    tpot_s: float | None = Field(None, gt=0, description="the controller's TPOT target for this class")
    ttft_s: float | None = Field(None, gt=0, description="the controller's TTFT target for this class")


class ShiftSpec(_Strict):
    at_s: float = Field(ge=0, description="simulated time of the change")
    acceptance: dict[Literal["ngram", "draft"], AcceptanceSpec] = Field(description="acceptance per drafter from then on")


class ClassSpec(_Strict):
    name: str = Field(min_length=1, description="request class label")
    weight: float = Field(1.0, ge=0, description="share of arrivals (normalised over classes)")
    weight_schedule: list[tuple[Annotated[float, Field(ge=0)], Annotated[float, Field(ge=0)]]] | None = Field(
        None, min_length=1, description="[[from_s, weight], ...]: the class's weight from each time on (before the "
                                        "first: `weight`); the mix moves over time without a trace")
    temperature: float = Field(0.0, ge=0, description="sampling temperature (the acceptance given is at this temperature)")
    prompt_tokens: LengthSpec | None = Field(None, description="prompt length distribution (not with a trace)")
    output_tokens: LengthSpec | None = Field(None, description="output length distribution (not with a trace)")
    acceptance: dict[Literal["ngram", "draft"], AcceptanceSpec] = Field(description="acceptance per drafter")
    slo: SLOSpec | None = Field(None, description="SLOs for goodput (default: the scenario's slo)")
    target: TargetSpec | None = Field(None, description="latency target the controller is told (none: throughput)")
    shift: ShiftSpec | None = Field(None, description="acceptance change mid-run")


# ---- workload ------------------------------------------------------------------------
class ConstantRate(_Strict):
    kind: Literal["constant"]
    rps: float = Field(gt=0, description="requests per second")


class StepRate(_Strict):
    kind: Literal["step"]
    steps: list[tuple[float, float]] = Field(min_length=1, description="[[from_s, rps], ...]")


class RampRate(_Strict):
    kind: Literal["ramp"]
    start_rps: float = Field(gt=0, description="rate at t = 0")
    end_rps: float = Field(gt=0, description="rate at the end of the run")


class DiurnalRate(_Strict):
    kind: Literal["diurnal"]
    mean_rps: float = Field(gt=0, description="mean rate")
    amplitude: float = Field(0.5, ge=0, lt=1, description="relative amplitude of the sine")
    period_s: float = Field(gt=0, description="period")


RateSpec = Annotated[Union[ConstantRate, StepRate, RampRate, DiurnalRate], Field(discriminator="kind")]


class ArrivalSpec(_Strict):
    process: Literal["poisson", "gamma"] = Field("poisson", description="inter-arrival law")
    burstiness: float = Field(1.0, gt=0, description="gamma shape (as vllm bench serve): < 1 burstier")


class TraceSpec(_Strict):
    path: str = Field(description="CSV with arrived_at, num_prefill_tokens, num_decode_tokens[, request_class]")
    time_scale: float = Field(1.0, gt=0, description="arrival times are divided by this (> 1 speeds up)")
    start_s: float = Field(0.0, ge=0, description="skip arrivals before this trace time")
    max_requests: int | None = Field(None, gt=0, description="take at most this many rows")


class ThinkTimeSpec(_Strict):
    dist: Literal["fixed", "exponential"] = Field("fixed", description="law of a client's pause between a reply "
                                                                       "and its next request")
    mean_s: float = Field(0.0, ge=0, description="mean pause in seconds (0: the next request goes at once, as "
                                                 "adaptspec loadtest's clients send it)")


class ClosedLoopSpec(_Strict):
    clients: int = Field(gt=0, description="clients, each sending its next request once its last one finished "
                                           "(and its think time passed); none start after duration_s")
    think_time: ThinkTimeSpec = Field(default_factory=ThinkTimeSpec, description="pause between a reply and the "
                                                                                 "client's next request")


class PromptSetSpec(_Strict):
    path: str = Field(description="CSV with request_class, num_prefill_tokens, num_decode_tokens (and optionally "
                                  "num_cached_tokens, prompt tokens a prefix cache serves, which are not prefilled): "
                                  "one row per prompt, each class's rows in the order they are sent (relative to "
                                  "the scenario)")
    order: Literal["round_robin", "random"] = Field(
        "round_robin", description="round_robin: the classes in turn (scenario order, weight > 0) and each class's "
                                   "prompts in turn, as adaptspec loadtest sends them; random: a class by weight, "
                                   "then one of its prompts uniformly")


class WorkloadSpec(_Strict):
    arrival: ArrivalSpec = Field(default_factory=ArrivalSpec, description="arrival process")
    rate: RateSpec | None = Field(None, description="rate schedule (not with trace)")
    trace: TraceSpec | None = Field(None, description="replay a request trace")
    closed_loop: ClosedLoopSpec | None = Field(None, description="a closed loop of clients instead of arrivals "
                                                                 "(not with rate or trace)")
    prompt_set: PromptSetSpec | None = Field(None, description="prompt and output lengths from a prompt set "
                                                               "instead of the classes' distributions (not with trace)")

    @model_validator(mode="after")
    def _one(self) -> "WorkloadSpec":
        given = [n for n in ("rate", "trace", "closed_loop") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"workload: give exactly one of rate, trace or closed_loop (got {given or 'none'})")
        if self.prompt_set is not None and self.trace is not None:
            raise ValueError("workload.prompt_set: not with a trace (the trace gives the lengths)")
        return self


class SweepSpec(_Strict):
    rps: list[Annotated[float, Field(gt=0)]] | None = Field(None, min_length=1,
                                                           description="constant rates to run in turn")
    clients: list[Annotated[int, Field(gt=0)]] | None = Field(None, min_length=1,
                                                             description="closed-loop client counts to run in turn")

    @model_validator(mode="after")
    def _one(self) -> "SweepSpec":
        if (self.rps is None) == (self.clients is None):
            raise ValueError("sweep: give exactly one of rps or clients")
        return self


# ---- hardware and policies -----------------------------------------------------------
class OffProfileSpec(_Strict):
    scale: float = Field(1.0, gt=0, description="every step's draft and verify time x this")
    drafted_scale: float = Field(1.0, gt=0, description="the share of a verify pass its drafted tokens add x this "
                                                        "instead")


class HardwareSpec(_Strict):
    profile: str | None = Field(None, description="built-in profile name (see adaptspec.control.gpu_profiles)")
    profile_file: str | None = Field(None, description="profile JSON (relative to the scenario)")
    replicas: int = Field(1, ge=1, description="replicas behind the router")
    router: Literal["round_robin", "least_loaded", "random"] = Field("least_loaded", description="routing rule")
    max_num_seqs: int | None = Field(None, gt=0, description="override the profile's running-request limit")
    max_batched_tokens: int | None = Field(None, gt=0, description="override the profile's step token budget")
    off_profile: OffProfileSpec | None = Field(
        None, description="price the simulated steps off the profile, as a live path can run off its calibration "
                          "(the oracle knows it; a policy seeded from the profile does not); null: the profile")

    @model_validator(mode="after")
    def _one(self) -> "HardwareSpec":
        if (self.profile is None) == (self.profile_file is None):
            raise ValueError("hardware: give exactly one of profile or profile_file")
        return self


class _PolicyBase(_Strict):
    label: str | None = Field(None, description="name in tables and plots")
    admission: bool | None = Field(None, description="SLO-aware admission for this policy's runs (null: the "
                                                     "scenario's `admission`)")
    pacing: bool | None = Field(None, description="TPOT-paced prefill for this policy's runs (null: the scenario's "
                                                  "`pacing`)")


class ThompsonSpec(_PolicyBase):
    kind: Literal["thompson"]
    discount: float = Field(0.995, gt=0, le=1, description="acceptance posterior discount per step of the drafter that ran it")
    cost_discount: float = Field(0.998, gt=0, le=1, description="cost-model discount per step")
    margin: float = Field(0.9, gt=0, le=1, description="keep predicted TPOT within margin x target")
    spread_z: float = Field(1.0, ge=0, description="budget TPOT at z standard errors below a short request's mean accepted length")
    short_tokens: float = Field(64.0, gt=0, description="output tokens of the short request spread_z is taken for")
    fade_half_life_s: float | None = Field(
        30.0, gt=0, description="seconds of steps in which every drafter's acceptance evidence loses half its "
                                "weight (a drafter that lost is tried again); null: no fading")
    fade_min_steps: int = Field(500, ge=1, description="... but never faster than half per this many steps")
    seed_cost_from_profile: bool = Field(False, description="seed the cost model with the hardware profile")
    headroom: float = Field(1.25, ge=1, description="capacity the plan seeks beyond the demand seen")
    replan_s: float = Field(0.5, gt=0, description="seconds of steps between plans (one posterior draw each)")
    replan_steps: int = Field(16, ge=1, description="... or this many steps, whichever comes first")
    demand_half_life_s: float = Field(4.0, gt=0, description="seconds of steps over which demand estimates forget")
    explore: float = Field(0.05, ge=0, lt=1, description="share of steps that move every class one k up or down")
    carry: float = Field(4.0, ge=0, description="acceptance at a position not yet reached: this many pseudo-counts "
                                                "at the mean of the position before (0: Beta(1, 1) at every position)")
    thresholds: list[float] | None = Field(None, description="draft-confidence thresholds it may set (null: the "
                                                             "scenario's `thresholds`; []: none)")


class UCBSpec(_PolicyBase):
    kind: Literal["ucb"]
    mode: Literal["discounted", "window"] = Field("discounted", description="forgetting rule")
    discount: float = Field(0.998, gt=0, le=1, description="discount per update")
    window: int = Field(300, gt=0, description="updates kept (window mode)")
    exploration: float = Field(0.05, ge=0, description="exploration weight")


class StaticSpec(_PolicyBase):
    kind: Literal["static"]
    drafter: Literal["none", "ngram", "draft"] = Field(description="drafter")
    k: int = Field(ge=0, le=16, description="drafted tokens per step")
    min_confidence: float = Field(0.0, ge=0, lt=1, description="stop a request's draft at its first token below "
                                                               "this confidence (0: never)")


class PerClassStaticSpec(_PolicyBase):
    kind: Literal["static_per_class"]
    arms: dict[str, str] = Field(min_length=1, description="class -> arm (`none`, `draft:2`, `draft:8@0.3`); "
                                                           "`*`: every class not named")


class AdaptiveVerificationSpec(_PolicyBase):
    kind: Literal["vllm_adaptive"]
    drafter: Literal["ngram", "draft"] = Field(description="drafter (needs draft confidences)")
    k: int | None = Field(None, ge=1, le=16, description="tokens every request drafts (vLLM's num_speculative_tokens); "
                                                        "null: max_k")


class ScheduleSpec(_PolicyBase):
    kind: Literal["vllm_schedule"]
    drafter: Literal["ngram", "draft"] = Field(description="drafter")
    schedule: list[tuple[int, int, int]] = Field(min_length=1, description="[[start_batch, end_batch, k], ...]")


class EmaSpec(_PolicyBase):
    kind: Literal["ema"]
    drafter: Literal["ngram", "draft"] = Field(description="drafter")
    start_k: int = Field(4, ge=1, le=16, description="initial k")
    alpha: float = Field(0.1, gt=0, le=1, description="EMA weight")
    up: float = Field(0.8, gt=0, lt=1, description="raise k above this acceptance rate")
    down: float = Field(0.5, gt=0, lt=1, description="lower k below this acceptance rate")


class HeuristicSpec(_PolicyBase):
    kind: Literal["heuristic"]
    drafter: Literal["ngram", "draft"] = Field(description="drafter")
    start_k: int = Field(5, ge=1, le=16, description="initial k")


class OraclePlannerSpec(_PolicyBase):
    kind: Literal["oracle_planner"]
    margin: float = Field(0.9, gt=0, le=1, description="keep TPOT within margin x target")
    spread_z: float = Field(1.0, ge=0, description="budget TPOT at z standard errors below a short request's mean accepted length")
    short_tokens: float = Field(64.0, gt=0, description="output tokens of the short request spread_z is taken for")
    headroom: float = Field(1.25, ge=1, description="capacity the plan seeks beyond the demand seen")
    replan_s: float = Field(0.5, gt=0, description="seconds of steps between plans")
    thresholds: list[float] | None = Field(None, description="draft-confidence thresholds it may set (null: the "
                                                             "scenario's `thresholds`; []: none)")


class OracleSpec(OraclePlannerSpec):
    kind: Literal["oracle"]
    epoch_s: float = Field(5.0, gt=0, description="simulated seconds between searches")
    horizon_s: float = Field(10.0, gt=0, description="simulated seconds each candidate is played forward")

    @model_validator(mode="after")
    def _epoch(self) -> "OracleSpec":
        if self.epoch_s > self.horizon_s:
            raise ValueError("epoch_s: must be <= horizon_s")
        return self


PolicySpec = Annotated[
    Union[ThompsonSpec, UCBSpec, StaticSpec, PerClassStaticSpec, ScheduleSpec, EmaSpec, HeuristicSpec, OracleSpec,
          OraclePlannerSpec, AdaptiveVerificationSpec],
    Field(discriminator="kind"),
]


def policy_label(spec: PolicySpec) -> str:
    if spec.label:
        return spec.label
    if isinstance(spec, StaticSpec):
        if spec.k == 0 or spec.drafter == "none":
            return "static-none"
        return f"static-{spec.drafter}:{spec.k}" + (f"@{spec.min_confidence:.2f}" if spec.min_confidence else "")
    if isinstance(spec, PerClassStaticSpec):
        return "static-" + ",".join(f"{c}={a}" for c, a in spec.arms.items())
    if isinstance(spec, UCBSpec):
        return "ucb" if spec.mode == "discounted" else "ucb-window"
    if isinstance(spec, AdaptiveVerificationSpec):
        return "vllm-adaptive" + (f"-k{spec.k}" if spec.k else "")
    return {"vllm_schedule": "vllm-schedule", "oracle_planner": "oracle-planner"}.get(spec.kind, spec.kind)


class AdmissionSpec(_Strict):
    slack: float = Field(0.8, gt=0, description="admit while the predicted TTFT is within slack x the class's TTFT target "
                                                "(the prediction is a mean: below 1 keeps the requests at the edge in it)")
    default: bool = Field(True, description="for policies that do not say (`admission:` on a policy overrides it)")


class PacingSpec(_Strict):
    margin: float = Field(0.9, gt=0, description="a step's time budget: margin x the tightest TPOT target x tokens "
                                                "per step of the TPOT classes decoding in it")
    slack: float = Field(0.8, gt=0, description="prompt work is never held past slack x its class's TTFT target")
    default: bool = Field(True, description="for policies that do not say (`pacing:` on a policy overrides it)")


class Scenario(_Strict):
    name: str = Field(description="scenario name")
    description: str = Field("", description="what it shows")
    seed: int = Field(0, description="random seed")
    duration_s: float = Field(gt=0, description="simulated seconds of arrivals")
    warmup_s: float = Field(0.0, ge=0, description="arrivals before this are not measured")
    drain_s: float = Field(120.0, ge=0, description="simulated seconds allowed after the last arrival")
    hardware: HardwareSpec = Field(description="cost profile and replicas")
    drafters: list[Literal["ngram", "draft"]] = Field(default_factory=lambda: ["ngram", "draft"],
                                                      description="drafters the deployment has")
    max_k: int = Field(8, ge=1, le=16, description="largest k a policy may choose")
    thresholds: list[float] = Field(default_factory=list, description="draft-confidence thresholds adaptive policies "
                                                                     "may set (per-token draft stopping), multiples "
                                                                     "of 0.1 in (0, 1); empty: none")
    admission: AdmissionSpec | None = Field(None, description="SLO-aware admission (refuse a request that cannot "
                                                              "meet its class's TTFT target); null: admit all")
    pacing: PacingSpec | None = Field(None, description="TPOT-paced prefill (cap each step's prompt chunks so the "
                                                        "classes with a TPOT target keep it; adaptspec.control.pacing); "
                                                        "null: prompt chunks fill every step's token budget")
    classes: list[ClassSpec] = Field(min_length=1, description="request classes")
    workload: WorkloadSpec = Field(description="arrivals")
    sweep: SweepSpec | None = Field(None, description="run the workload at several constant rates")
    slo: SLOSpec = Field(default_factory=SLOSpec, description="default SLOs for goodput")
    policies: list[PolicySpec] = Field(min_length=1, description="policies to compare")
    targets_from_slo: bool = Field(True, description="a class without a target takes its SLO's TPOT/TTFT as the target")
    timeline_bin_s: float = Field(10.0, gt=0, description="bin width of over-time metrics")

    @model_validator(mode="after")
    def _check(self) -> "Scenario":
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError("classes: names must be unique")
        if self.sweep is not None and self.sweep.clients is not None and self.workload.closed_loop is None:
            raise ValueError("sweep.clients: needs a workload.closed_loop")
        if self.sweep is not None and self.sweep.rps is not None and self.workload.closed_loop is not None:
            raise ValueError("sweep.rps: a closed loop has no rate (sweep clients instead)")
        for i, c in enumerate(self.classes):
            if self.workload.trace is None and self.workload.prompt_set is None:
                for f in ("prompt_tokens", "output_tokens"):
                    if getattr(c, f) is None:
                        raise ValueError(f"classes.{i}.{f}: required unless the workload is a trace or has a "
                                         f"prompt_set")
            for d in self.drafters:
                if d not in c.acceptance:
                    raise ValueError(f"classes.{i}.acceptance: missing drafter {d!r}")
        for i, p in enumerate(self.policies):
            _check_policy(p, i, self)
        for t in self.thresholds:
            if not 0 < t < 1 or abs(t * 10 - round(t * 10)) > 1e-9:
                raise ValueError(f"thresholds: {t} is not a multiple of 0.1 within (0, 1)")
        labels = [policy_label(p) for p in self.policies]
        if len(set(labels)) != len(labels):
            raise ValueError("policies: labels must be unique (set label:)")
        if self.warmup_s >= self.duration_s:
            raise ValueError("warmup_s: must be < duration_s")
        return self


def _check_arm(drafter: str, k: int, sc: "Scenario", where: str) -> None:
    if k > sc.max_k:
        raise ValueError(f"{where}.k: {k} exceeds max_k {sc.max_k}")
    if k and drafter != "none" and drafter not in sc.drafters:
        raise ValueError(f"{where}.drafter: {drafter!r} is not deployed (drafters: {list(sc.drafters)})")


def _check_policy(p, i: int, sc: "Scenario") -> None:
    """Arms a policy may run must exist in the scenario: a k above max_k, or a drafter it
    does not deploy, is an error naming the key (not an arm run at a k it is not charged for)."""
    where = f"policies.{i}"
    for t in getattr(p, "thresholds", None) or ():
        if not 0 < t < 1 or abs(t * 10 - round(t * 10)) > 1e-9:
            raise ValueError(f"{where}.thresholds: {t} is not a multiple of 0.1 within (0, 1)")
    if isinstance(p, StaticSpec):
        _check_arm(p.drafter, p.k, sc, where)
    elif isinstance(p, PerClassStaticSpec):
        from adaptspec.control.types import Arm

        names = {c.name for c in sc.classes} | {"*"}
        for c, text in p.arms.items():
            if c not in names:
                raise ValueError(f"{where}.arms.{c}: not a class of the scenario ({sorted(names - {'*'})})")
            try:
                arm = Arm.parse(text)
            except ValueError as exc:
                raise ValueError(f"{where}.arms.{c}: {exc}") from None
            _check_arm(arm.drafter, arm.k, sc, f"{where}.arms.{c}")
    elif isinstance(p, ScheduleSpec):
        _check_arm(p.drafter, 1, sc, where)
        for j, (start, end, k) in enumerate(p.schedule):
            if k > sc.max_k:
                raise ValueError(f"{where}.schedule.{j}: k {k} exceeds max_k {sc.max_k}")
            if start > end or k < 0:
                raise ValueError(f"{where}.schedule.{j}: need start <= end and k >= 0")
    elif isinstance(p, (EmaSpec, HeuristicSpec)):
        _check_arm(p.drafter, 1, sc, where)
        if p.start_k > sc.max_k:
            raise ValueError(f"{where}.start_k: {p.start_k} exceeds max_k {sc.max_k}")
    elif isinstance(p, AdaptiveVerificationSpec):
        _check_arm(p.drafter, p.k or 1, sc, where)
        if not any(c.acceptance[p.drafter].confidence is not None for c in sc.classes if p.drafter in c.acceptance):
            raise ValueError(f"{where}.drafter: vllm_adaptive ranks tokens by draft confidence; no class gives "
                             f"{p.drafter!r} a `confidence:`")


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        lines.append(f"{loc or '<scenario>'}: {e['msg']}")
    return "; ".join(lines)


def parse_scenario(data: dict, source: str = "<scenario>") -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as e:
        raise ValueError(f"{source}: {_format_errors(e)}") from None


def load_scenario(path: str | Path) -> tuple[Scenario, Path]:
    """Read and validate a scenario; returns it and its folder (for relative paths)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return parse_scenario(data, str(path)), path.parent
