"""Policy names an operator can pick (config, ``UpdatePolicy``) -> ``adaptspec.control`` policies."""
from __future__ import annotations

from adaptspec.control import (
    Arm, ClassTarget, DiscountedUCB, EmaPolicy, HeuristicPolicy, ModelBasedThompson, Policy, PolicyConfig,
    StaticPolicy,
)

AVAILABLE = ("thompson", "ucb", "ema", "heuristic", "static:<drafter>:<k>")


def make_policy(name: str, *, drafters: tuple[str, ...], max_k: int, targets: tuple[ClassTarget, ...] = (),
                seed: int = 0, field: str = "policy") -> Policy:
    """Build a policy by name; ValueError names ``field`` on a bad name."""
    cfg = PolicyConfig(drafters=tuple(drafters), max_k=max_k, targets=targets, seed=seed)
    base, _, rest = name.partition(":")
    best = "draft" if "draft" in drafters else drafters[0]
    if base == "thompson":
        return ModelBasedThompson(cfg)
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
