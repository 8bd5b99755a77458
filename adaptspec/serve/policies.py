"""Policy names an operator can pick (config, ``UpdatePolicy``) -> ``adaptspec.control`` policies."""
from __future__ import annotations

from adaptspec.control import (
    Arm, ClassTarget, DiscountedUCB, EmaPolicy, HeuristicPolicy, ModelBasedThompson, Policy, PolicyConfig,
    StaticPolicy, ThompsonConfig,
)

AVAILABLE = ("thompson", "ucb", "ema", "heuristic", "static:<drafter>:<k>")


def make_policy(name: str, *, drafters: tuple[str, ...], max_k: int, targets: tuple[ClassTarget, ...] = (),
                seed: int = 0, prior_cost=None, fade_half_life_s: float | None = 60.0,
                thresholds: tuple[float, ...] = (), field: str = "policy") -> Policy:
    """Build a policy by name; ValueError names ``field`` on a bad name. ``prior_cost``: a
    ``StepCostModel`` seeding the model-based policy; ``fade_half_life_s``: its evidence fading
    (``ThompsonConfig.fade_half_life_s``)."""
    cfg = PolicyConfig(drafters=tuple(drafters), max_k=max_k, targets=targets, seed=seed, thresholds=tuple(thresholds))
    base, _, rest = name.partition(":")
    best = "draft" if "draft" in drafters else drafters[0]
    if base == "thompson":
        return ModelBasedThompson(cfg, ThompsonConfig(fade_half_life_s=fade_half_life_s), prior_cost=prior_cost)
    if base == "ucb":
        return DiscountedUCB(cfg)
    if base == "ema":
        return EmaPolicy(best, cfg, start_k=min(4, max_k))
    if base == "heuristic":
        return HeuristicPolicy(best, cfg, start_k=min(5, max_k))
    if base == "static":
        drafter, _, k = rest.partition(":")
        try:
            arm = Arm(drafter or "none", int(k or 0))
        except ValueError as exc:
            raise ValueError(f"{field}: {name!r}: {exc}") from None
        if arm.k and arm.drafter not in drafters:
            raise ValueError(f"{field}: {name!r} uses drafter {arm.drafter!r}; this deployment has {drafters}")
        if arm.k > max_k:
            raise ValueError(f"{field}: {name!r}: k={arm.k} exceeds max_k={max_k}")
        return StaticPolicy(arm, cfg)
    raise ValueError(f"{field}: unknown policy {name!r}; one of {', '.join(AVAILABLE)}")


def load_cost_prior(spec: str | None, *, target: str, dtype: str, device: str):
    """The step-cost prior named by ``controller.cost_profile`` (None: none)."""
    if spec is None:
        return None
    from adaptspec.control.gpu_profiles import BUILTIN, builtin_profile

    if spec == "auto":
        if target == "smollm2-135m" and device == "cpu" and dtype in ("float32", "bfloat16"):
            return measured_cpu_prior(dtype)
        return None
    if spec in BUILTIN:
        return builtin_profile(spec)
    from adaptspec.control.costs import ProfileCostModel

    try:
        return ProfileCostModel.load(spec)
    except (OSError, ValueError) as exc:
        raise ValueError(f"controller.cost_profile: {spec!r} is neither a built-in profile ({', '.join(BUILTIN)}) "
                         f"nor a readable profile JSON ({exc})") from None


def measured_cpu_prior(dtype: str):
    """The step costs of SmolLM2-135M + its draft head on the CPU, as ``adaptspec calibrate``
    measured them on the project's 2-core test box (``adaptspec/data/profiles``; its notes
    say how). ``auto`` seeds the controller with these rather than the built-in
    ``cpu-smollm2-135m-*`` profiles, whose numbers come from the issues' statements: a prior
    far off keeps the policy from ever trying the arms it overprices, because the online
    fit only learns where the policy goes (the comparison: docs/benchmarks.md)."""
    from importlib import resources

    from adaptspec.control.costs import ProfileCostModel

    name = "cpu-smollm2-135m-" + ("fp32" if dtype == "float32" else "bf16") + "-measured.json"
    with resources.as_file(resources.files("adaptspec.data").joinpath("profiles").joinpath(name)) as path:
        return ProfileCostModel.load(path)
