"""Turn a validated scenario into runs: truths, cost model, workload, policies, metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from adaptspec.control import (
    AdaptiveVerificationPolicy,
    Arm,
    BatchSchedulePolicy,
    ClassTarget,
    DiscountedUCB,
    EmaPolicy,
    HeuristicPolicy,
    ModelBasedThompson,
    PerClassStaticPolicy,
    PlannerOracle,
    Policy,
    PolicyConfig,
    ScheduleRange,
    SloAdmission,
    StaticPolicy,
    ThompsonConfig,
    UCBConfig,
)
from adaptspec.control.types import CONF_BINS
from adaptspec.sim.acceptance import (
    AcceptanceModel,
    BernoulliAcceptance,
    ConfidenceAcceptance,
    PositionAcceptance,
    ReplayAcceptance,
)
from adaptspec.control.costs import ProfileCostModel
from adaptspec.control.gpu_profiles import builtin_profile
from adaptspec.control.pacing import PrefillPacer
from adaptspec.sim.metrics import SLO, RunMetrics, compute_metrics
from adaptspec.sim.replica import ClassTruth
from adaptspec.sim.lookahead import LookaheadOracle
from adaptspec.sim.scenario import (
    AcceptanceSpec,
    AdaptiveVerificationSpec,
    ConstantRate,
    EmaSpec,
    HeuristicSpec,
    OraclePlannerSpec,
    OracleSpec,
    PacingSpec,
    PerClassStaticSpec,
    PolicySpec,
    Scenario,
    ScheduleSpec,
    StaticSpec,
    ThompsonSpec,
    UCBSpec,
    WorkloadSpec,
    policy_label,
)
from adaptspec.sim.simulator import RunSetup, simulate
from adaptspec.sim.workload import Requests, read_trace, synthesize


def acceptance_model(spec: AcceptanceSpec, base: Path, where: str, request_class: str | None = None,
                     drafter: str | None = None) -> AcceptanceModel:
    if spec.recorded is not None:
        from adaptspec.sim.acceptance_replay import recorded_model

        return recorded_model(spec.recorded, base, f"{where}.recorded", request_class, drafter)
    if spec.bernoulli is not None:
        return BernoulliAcceptance(spec.bernoulli)
    if spec.positions is not None:
        return PositionAcceptance(np.array(spec.positions))
    r = spec.replay
    if r.file is not None:
        path = Path(r.file) if Path(r.file).is_absolute() else base / r.file
        if not path.exists():
            raise ValueError(f"{where}.replay.file: {path} does not exist")
        lengths = [int(x) for x in path.read_text().split()]
    else:
        lengths = r.accepted_lengths
    if not lengths or min(lengths) < 1 or max(lengths) > r.recorded_k + 1:
        raise ValueError(f"{where}.replay: accepted lengths must lie in 1..recorded_k + 1")
    return ReplayAcceptance(np.array(lengths) - 1, r.recorded_k)


def with_confidence(spec: AcceptanceSpec, model: AcceptanceModel) -> AcceptanceModel | ConfidenceAcceptance:
    """``model`` wrapped in the drafter's confidence model when the spec gives one."""
    cf = spec.confidence
    if cf is None:
        return model
    return ConfidenceAcceptance(model, cf.concentration, None if cf.calibration is None else np.array(cf.calibration))


def class_truths(sc: Scenario, base: Path) -> list[ClassTruth]:
    out = []
    for i, c in enumerate(sc.classes):
        acc = {d: with_confidence(a, acceptance_model(a, base, f"classes.{i}.acceptance.{d}", c.name, d))
               for d, a in c.acceptance.items()}
        shifted = None
        if c.shift is not None:
            shifted = dict(acc)
            shifted.update({d: with_confidence(a, acceptance_model(a, base, f"classes.{i}.shift.acceptance.{d}", c.name, d))
                            for d, a in c.shift.acceptance.items()})
        out.append(ClassTruth(c.name, acc, c.shift.at_s if c.shift else None, shifted))
    return out


def cost_model(sc: Scenario, base: Path) -> ProfileCostModel:
    hw = sc.hardware
    if hw.profile is not None:
        model = builtin_profile(hw.profile)
    else:
        path = Path(hw.profile_file) if Path(hw.profile_file).is_absolute() else base / hw.profile_file
        if not path.exists():
            raise ValueError(f"hardware.profile_file: {path} does not exist")
        model = ProfileCostModel.load(path)
    update = {k: getattr(hw, k) for k in ("max_num_seqs", "max_batched_tokens") if getattr(hw, k) is not None}
    if update:
        model = ProfileCostModel(model.profile.model_copy(update=update))
    if hw.off_profile is not None:
        model = ProfileCostModel(model.profile, scale=hw.off_profile.scale, drafted_scale=hw.off_profile.drafted_scale)
    return model


@dataclass(slots=True)
class PolicyRun:
    policy: Policy
    on_shift: Callable[[], None] | None = None


def scenario_targets(sc: Scenario) -> tuple[ClassTarget, ...]:
    targets = []
    for c in sc.classes:
        t = c.target
        if t is None and sc.targets_from_slo:
            t = c.slo or sc.slo
        if t is not None and (t.tpot_s is not None or t.ttft_s is not None):
            targets.append(ClassTarget(c.name, t.tpot_s, t.ttft_s))
    return tuple(targets)


def scenario_slos(sc: Scenario) -> list[SLO]:
    out = []
    for c in sc.classes:
        s = c.slo or sc.slo
        out.append(SLO(s.ttft_s, s.tpot_s, s.e2e_s))
    return out


def static_assignments(sc: Scenario) -> list[dict[str, Arm]]:
    """Every static arm and per-class static assignment the scenario compares (``*``: all classes)."""
    out = []
    for p in sc.policies:
        if isinstance(p, StaticSpec):
            out.append({"*": Arm(p.drafter, p.k, p.min_confidence)})
        elif isinstance(p, PerClassStaticSpec):
            out.append({c: Arm.parse(a) for c, a in p.arms.items()})
    return out


def admission_for(spec: PolicySpec, sc: Scenario) -> SloAdmission | None:
    """The policy's SLO-aware admission (TTFT targets from the classes' SLOs)."""
    on = spec.admission if spec.admission is not None else (sc.admission is not None and sc.admission.default)
    if not on:
        return None
    ttft = {c.name: (c.slo or sc.slo).ttft_s for c in sc.classes if (c.slo or sc.slo).ttft_s is not None}
    return SloAdmission(ttft, sc.admission.slack) if sc.admission is not None else SloAdmission(ttft)


def pacer_for(spec: PolicySpec, sc: Scenario) -> PrefillPacer | None:
    """The policy's TPOT-paced prefill (TPOT and TTFT targets from the classes' SLOs); None
    when off or when no class has a TPOT target."""
    on = spec.pacing if spec.pacing is not None else (sc.pacing is not None and sc.pacing.default)
    slos = {c.name: c.slo or sc.slo for c in sc.classes}
    tpot = {c: s.tpot_s for c, s in slos.items() if s is not None and s.tpot_s is not None}
    if not on or not tpot:
        return None
    ttft = {c: s.ttft_s for c, s in slos.items() if s is not None and s.ttft_s is not None}
    ps = sc.pacing or PacingSpec()
    return PrefillPacer(tpot, ttft, margin=ps.margin, slack=ps.slack)


def build_policy(spec: PolicySpec, sc: Scenario, truths: list[ClassTruth], cost: ProfileCostModel,
                 clock: list[float], seed: int) -> PolicyRun:
    """``clock`` holds the current simulated time (the oracle reads shifted truths by it)."""
    targets = scenario_targets(sc)
    prof = cost.profile
    own = getattr(spec, "thresholds", None)
    cfg = PolicyConfig(tuple(sc.drafters), sc.max_k, targets, seed, tuple(sc.thresholds if own is None else own),
                       prof.max_num_seqs, prof.max_batched_tokens)
    if isinstance(spec, ThompsonSpec):
        p = ModelBasedThompson(cfg, ThompsonConfig(
            discount=spec.discount, cost_discount=spec.cost_discount, margin=spec.margin, spread_z=spec.spread_z,
            short_tokens=spec.short_tokens, fade_half_life_s=spec.fade_half_life_s,
            fade_min_steps=spec.fade_min_steps, headroom=spec.headroom,
            replan_s=spec.replan_s, replan_steps=spec.replan_steps, demand_half_life_s=spec.demand_half_life_s,
            explore=spec.explore, carry=spec.carry),
            prior_cost=cost.prior() if spec.seed_cost_from_profile else None)
    elif isinstance(spec, UCBSpec):
        p = DiscountedUCB(cfg, UCBConfig(spec.mode, spec.discount, spec.window, spec.exploration))
    elif isinstance(spec, StaticSpec):
        p = StaticPolicy(Arm(spec.drafter, spec.k, spec.min_confidence), cfg)
    elif isinstance(spec, PerClassStaticSpec):
        arms = {c: Arm.parse(a) for c, a in spec.arms.items()}
        p = PerClassStaticPolicy({c: a for c, a in arms.items() if c != "*"}, cfg, default=arms.get("*", Arm()))
        p.name = policy_label(spec)
    elif isinstance(spec, AdaptiveVerificationSpec):
        p = AdaptiveVerificationPolicy(spec.drafter, cost.verify_s, cfg, k=spec.k)
        p.name = policy_label(spec)
    elif isinstance(spec, ScheduleSpec):
        p = BatchSchedulePolicy(spec.drafter, [ScheduleRange(*r) for r in spec.schedule], cfg)
    elif isinstance(spec, EmaSpec):
        p = EmaPolicy(spec.drafter, cfg, start_k=spec.start_k, alpha=spec.alpha, up=spec.up, down=spec.down)
    elif isinstance(spec, HeuristicSpec):
        p = HeuristicPolicy(spec.drafter, cfg, start_k=spec.start_k)
    elif isinstance(spec, (OracleSpec, OraclePlannerSpec)):
        by_name = {t.name: t for t in truths}
        K = sc.max_k

        def truth(request_class: str, drafter: str) -> np.ndarray:
            t = by_name.get(request_class)
            if t is None:
                return np.zeros(K)
            return t.at(clock[0])[drafter].position_probs(K)

        def conf_truth(request_class: str, drafter: str, bins: np.ndarray):
            t = by_name.get(request_class)
            m = None if t is None else t.at(clock[0]).get(drafter)
            if not isinstance(m, ConfidenceAcceptance):
                return None
            return m.threshold_curves(K, bins, CONF_BINS)

        p = PlannerOracle(truth, cost, cfg, confidence=conf_truth, margin=spec.margin, headroom=spec.headroom,
                          replan_s=spec.replan_s, spread_z=spec.spread_z, short_tokens=spec.short_tokens)
        if isinstance(spec, OracleSpec):
            p = LookaheadOracle(p, cfg, [c.name for c in sc.classes], scenario_slos(sc),
                                statics=static_assignments(sc), epoch_s=spec.epoch_s, horizon_s=spec.horizon_s,
                                window=(sc.warmup_s, sc.duration_s))
        return PolicyRun(p, p.invalidate)
    else:  # pragma: no cover - the union is closed
        raise ValueError(f"policies: unknown kind {spec!r}")
    return PolicyRun(p)


@dataclass(slots=True)
class ScenarioResult:
    scenario: str
    runs: list[RunMetrics] = field(default_factory=list)
    policy_notes: dict[str, str] = field(default_factory=dict)


def _workload(sc: Scenario, base: Path, rate: float | None, rng: np.random.Generator) -> Requests:
    wl = sc.workload
    if wl.trace is not None:
        return read_trace(wl.trace, base, sc.classes, sc.duration_s, rng)
    if rate is not None:
        wl = WorkloadSpec(arrival=wl.arrival, rate=ConstantRate(kind="constant", rps=rate), prompt_set=wl.prompt_set)
    if wl.prompt_set is not None:
        from adaptspec.sim.closed_loop import open_loop_requests

        return open_loop_requests(wl, sc.classes, sc.duration_s, base, rng)
    return synthesize(wl, sc.classes, sc.duration_s, rng)


def run_scenario(sc: Scenario, base: Path | None, *, only: list[str] | None = None, seed: int | None = None,
                 progress: Callable[[str, float], None] | None = None,
                 policy_seed: int | None = None) -> ScenarioResult:
    """``policy_seed``: the policies' own random draws (default: ``seed``, which also sets the
    requests and acceptance draws; ``simulations/policy_seeds.py`` varies it alone)."""
    seed = sc.seed if seed is None else seed
    base = Path(".") if base is None else base
    truths = class_truths(sc, base)
    cost = cost_model(sc, base)
    specs = [p for p in sc.policies if only is None or policy_label(p) in only]
    if only:
        unknown = set(only) - {policy_label(p) for p in sc.policies}
        if unknown:
            raise ValueError(f"--policy: {sorted(unknown)} not in the scenario's policies "
                             f"{[policy_label(p) for p in sc.policies]}")
    if sc.workload.closed_loop is not None:
        from adaptspec.sim.closed_loop import run_closed_loop

        return run_closed_loop(sc, base, specs, seed=seed, progress=progress)
    rates = sc.sweep.rps if sc.sweep is not None else [None]
    result = ScenarioResult(sc.name)
    slos = scenario_slos(sc)
    for rate in rates:
        # common random numbers: every policy sees the same requests and acceptance draws
        requests = _workload(sc, base, rate, np.random.default_rng([seed, 1]))
        for spec in specs:
            label = policy_label(spec)
            clock = [0.0]
            run = build_policy(spec, sc, truths, cost, clock, seed if policy_seed is None else policy_seed)
            result.policy_notes[label] = run.policy.describe_targets()
            setup = RunSetup(cost, truths, requests, sc.hardware.replicas, sc.hardware.router, sc.max_k,
                             sc.duration_s, sc.drain_s, sc.timeline_bin_s, seed, tuple(sc.drafters),
                             admission_for(spec, sc), pacer=pacer_for(spec, sc))

            def on_progress(f: float, label=label, clock=clock) -> None:
                clock[0] = f * (sc.duration_s + sc.drain_s)
                if progress is not None:
                    progress(f"{label}" + (f" @ {rate:g} rps" if rate else ""), f)

            out = simulate(setup, run.policy, on_shift=_shift_hook(run, clock, truths), progress=on_progress)
            st = run.policy.stats
            result.runs.append(compute_metrics(
                label, rate, requests, out.recorder, [c.name for c in sc.classes], slos, sc.warmup_s,
                sc.duration_s, out.end_s, out.wall_s, out.steps, st.mean_decision_us, st.decision_s_max * 1e6))
    return result


def _shift_hook(run: PolicyRun, clock: list[float], truths: list[ClassTruth]) -> Callable[[], None]:
    shifts = sorted({t.shift_at_s for t in truths if t.shift_at_s is not None})  # as the simulator: once per time

    def hook() -> None:
        # the simulator calls this exactly when simulated time passes a shift
        if shifts:
            clock[0] = shifts.pop(0)
        if run.on_shift is not None:
            run.on_shift()

    return hook
