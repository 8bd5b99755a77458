"""Policy names an operator can pick (config, ``UpdatePolicy``) -> ``adaptspec.control`` policies."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from pathlib import Path

from adaptspec.control import (
    Arm, ClassTarget, DiscountedUCB, EmaPolicy, HeuristicPolicy, ModelBasedThompson, PerClassStaticPolicy, Policy,
    PolicyConfig, StaticPolicy, ThompsonConfig,
)

AVAILABLE = ("thompson", "ucb", "ema", "heuristic", "static:<drafter>:<k>[/<class>=<drafter>:<k>...]")
log = logging.getLogger("adaptspec.serve.policies")


_THOMPSON = ThompsonConfig()  # the fading defaults, kept in one place


def make_policy(name: str, *, drafters: tuple[str, ...], max_k: int, targets: tuple[ClassTarget, ...] = (),
                seed: int = 0, prior_cost=None, fade_half_life_s: float | None = _THOMPSON.fade_half_life_s,
                fade_min_steps: int = _THOMPSON.fade_min_steps,
                thresholds: tuple[float, ...] = (), field: str = "policy",
                classes: tuple[str, ...] | None = None) -> Policy:
    """Build a policy by name; ValueError names ``field`` on a bad name. ``prior_cost``: a
    ``StepCostModel`` seeding the model-based policy; ``fade_half_life_s``, ``fade_min_steps``: its
    evidence fading (``ThompsonConfig``). ``classes``: the deployment's classes, which a per-class
    static policy (``static:none:0/extraction=ngram:2``) may name (None: any name)."""
    cfg = PolicyConfig(drafters=tuple(drafters), max_k=max_k, targets=targets, seed=seed, thresholds=tuple(thresholds))
    base, _, rest = name.partition(":")
    best = "draft" if "draft" in drafters else drafters[0]
    if base == "thompson":
        return ModelBasedThompson(cfg, ThompsonConfig(fade_half_life_s=fade_half_life_s, fade_min_steps=fade_min_steps),
                                  prior_cost=prior_cost)
    if base == "ucb":
        return DiscountedUCB(cfg)
    if base == "ema":
        return EmaPolicy(best, cfg, start_k=min(4, max_k))
    if base == "heuristic":
        return HeuristicPolicy(best, cfg, start_k=min(5, max_k))
    if base == "static":
        # static:<drafter>:<k> for every class, or with /<class>=<drafter>:<k> overrides: the fair
        # static reference when classes differ (each class on its own best arm, none adapting)
        default, *overrides = rest.split("/")
        arm = _static_arm(default or "none:0", name, drafters, max_k, field)
        arms = {}
        for part in overrides:
            cls, eq, spec = part.partition("=")
            if not eq or not cls:
                raise ValueError(f"{field}: {name!r}: {part!r} is not <class>=<drafter>:<k>")
            if classes is not None and cls not in classes:
                raise ValueError(f"{field}: {name!r} names class {cls!r}; this deployment has {list(classes)}")
            if cls in arms:
                raise ValueError(f"{field}: {name!r} names class {cls!r} twice")
            arms[cls] = _static_arm(spec, name, drafters, max_k, field)
        return PerClassStaticPolicy(arms, cfg, default=arm) if arms else StaticPolicy(arm, cfg)
    raise ValueError(f"{field}: unknown policy {name!r}; one of {', '.join(AVAILABLE)}")


def _static_arm(spec: str, name: str, drafters: tuple[str, ...], max_k: int, field: str) -> Arm:
    drafter, _, k = spec.partition(":")
    try:
        arm = Arm(drafter or "none", int(k or 0))
    except ValueError as exc:
        raise ValueError(f"{field}: {name!r}: {exc}") from None
    if arm.k and arm.drafter not in drafters:
        raise ValueError(f"{field}: {name!r} uses drafter {arm.drafter!r}; this deployment has {drafters}")
    if arm.k > max_k:
        raise ValueError(f"{field}: {name!r}: k={arm.k} exceeds max_k={max_k}")
    return arm


def load_cost_prior(spec: str | None, *, target: str, dtype: str, device: str, draft: str | None = None,
                    gpu_name: str | None = None):
    """The step-cost prior named by ``controller.cost_profile`` (None: none).

    ``auto``: SmolLM2-135M on the CPU gets its measured profile; on CUDA, the built-in
    H100/H200 profile method matched to the target's (and draft's) shapes
    (``matched_gpu_prior``). ``auto:<gpu>`` (e.g. ``auto:h200``) names the GPU, for a
    controller that runs where the replicas' GPU cannot be seen."""
    if spec is None:
        return None
    from adaptspec.control.gpu_profiles import BUILTIN, builtin_profile

    if spec == "auto" or spec.startswith("auto:"):
        named = spec.partition(":")[2] or None
        if dtype == "auto":  # models.dtype's default, as the loader resolves it: bfloat16 on a GPU
            dtype = "bfloat16" if named or str(device).startswith("cuda") else "float32"
        if not named and target == "smollm2-135m" and device == "cpu" and dtype in ("float32", "bfloat16"):
            return measured_cpu_prior(dtype)
        if named or str(device).startswith("cuda"):
            return matched_gpu_prior(target, draft, dtype, device, gpu_name or named)
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


_NO_PRIOR = ("; the controller learns step costs online only (for a measured prior run `adaptspec calibrate` on "
             "the GPU and set controller.cost_profile to its JSON)")


def matched_gpu_prior(target: str, draft: str | None, dtype: str, device: str, gpu_name: str | None = None):
    """The built-in H100/H200 profile method applied to the target's shapes (its local
    ``config.json``; nothing is downloaded) on the GPU ``gpu_name`` (else
    ``$ADAPTSPEC_GPU_NAME``, else what nvidia-smi names for ``device``). Logs what was matched
    and with what scale; None, with a warning saying why, when nothing fits."""
    from adaptspec.control.costs import ProfileCostModel
    from adaptspec.control.gpu_profiles import ModelShape, ProfileMismatch, match_gpu_profile

    name, where = gpu_name, "controller.cost_profile"
    if not name and os.environ.get("ADAPTSPEC_GPU_NAME"):
        name, where = os.environ["ADAPTSPEC_GPU_NAME"], "ADAPTSPEC_GPU_NAME"
    if not name:
        name, where = visible_gpu_name(device), "nvidia-smi"
    if not name:
        log.warning("cost prior: no GPU visible to the controller (nvidia-smi) and ADAPTSPEC_GPU_NAME unset, so no "
                    "built-in GPU profile can be matched%s; controller.cost_profile auto:h100 / auto:h200 names the "
                    "GPU", _NO_PRIOR)
        return None
    cfg = local_model_config(target)
    if cfg is None:
        log.warning("cost prior: the target %r has no config.json on this machine (not pulled yet?), so its shapes "
                    "are unknown%s", target, _NO_PRIOR)
        return None
    dcfg = local_model_config(draft) if draft else None  # a draft head has draft.json: priced as the 1B draft
    try:
        m = match_gpu_profile(name, ModelShape.from_config(cfg, dtype),
                              ModelShape.from_config(dcfg, dtype) if dcfg else None)
    except ProfileMismatch as e:
        log.warning("cost prior: no built-in GPU profile matches %s (%s) on %r (from %s): %s%s", target, dtype, name,
                    where, e, _NO_PRIOR)
        return None
    log.info("cost prior: %s (%s) on %r (from %s) matched %s", target, dtype, name, where, m.describe())
    return ProfileCostModel(m.profile)


def visible_gpu_name(device: str) -> str | None:
    """The name nvidia-smi gives the GPU of ``device`` ("cuda" or "cuda:N"); None where there
    is none (no CUDA context is created: the controller holds no GPU)."""
    m = re.fullmatch(r"cuda(?::(\d+))?", str(device).strip())
    index = int(m.group(1) or 0) if m else 0
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    names = [x.strip() for x in r.stdout.splitlines() if x.strip()] if r.returncode == 0 else []
    return names[index] if index < len(names) else None


def local_model_config(spec: str | None) -> dict | None:
    """The ``config.json`` of a model spec where it is already on this machine (alias in the
    cache or packaged, local folder, a hub id's download folder); None otherwise."""
    if not spec:
        return None
    from adaptspec.models.registry import _HUB_ID, BUILTIN, alias_dir, models_dir, packaged_dir

    if spec in BUILTIN:
        folder = packaged_dir(spec) if BUILTIN[spec].packaged else alias_dir(spec)
    elif Path(spec).expanduser().is_dir():
        folder = Path(spec).expanduser()
    elif _HUB_ID.match(spec):
        folder = models_dir() / "hub" / spec.replace("/", "--")
    else:
        return None
    f = folder / "config.json"
    try:
        return json.loads(f.read_text()) if f.is_file() else None
    except (OSError, ValueError):
        return None
