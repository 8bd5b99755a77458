"""Policy names an operator can pick (config, ``UpdatePolicy``) -> ``adaptspec.control`` policies."""
from __future__ import annotations

from adaptspec.control import (
    Arm, ClassTarget, DiscountedUCB, EmaPolicy, HeuristicPolicy, ModelBasedThompson, Policy, PolicyConfig,
    StaticPolicy,
)

AVAILABLE = ("thompson", "ucb", "ema", "heuristic", "static:<drafter>:<k>")


def make_policy(name: str, *, drafters: tuple[str, ...], max_k: int, targets: tuple[ClassTarget, ...] = (),
                seed: int = 0, prior_cost=None, field: str = "policy") -> Policy:
    """Build a policy by name; ValueError names ``field`` on a bad name. ``prior_cost``: a
    ``StepCostModel`` seeding the model-based policy."""
    cfg = PolicyConfig(drafters=tuple(drafters), max_k=max_k, targets=targets, seed=seed)
    base, _, rest = name.partition(":")
    best = "draft" if "draft" in drafters else drafters[0]
    if base == "thompson":
        return ModelBasedThompson(cfg, prior_cost=prior_cost)
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
    from adaptspec.sim.gpu import BUILTIN, builtin_profile

    if spec == "auto":
        if target == "smollm2-135m" and device == "cpu" and dtype in ("float32", "bfloat16"):
            return builtin_profile("cpu-smollm2-135m-" + ("fp32" if dtype == "float32" else "bf16"))
        return None
    if spec in BUILTIN:
        return builtin_profile(spec)
    from adaptspec.sim.costs import ProfileCostModel

    try:
        return ProfileCostModel.load(spec)
    except (OSError, ValueError) as exc:
        raise ValueError(f"controller.cost_profile: {spec!r} is neither a built-in profile ({', '.join(BUILTIN)}) "
                         f"nor a readable profile JSON ({exc})") from None
