"""Proto <-> internal types, and request validation (ValueError names the proto field).

Ray-free and torch-free: the Ingress runs it, unit tests call it directly.
"""
from __future__ import annotations

import math
import uuid

from adaptspec.control.types import MAX_K, Arm
from adaptspec.engine.params import DRAFTERS, SamplingParams
from adaptspec.proto import adaptspec_pb2 as pb
from adaptspec.serve.config import ServiceConfig
from adaptspec.serve.types import EngineChunk, EngineRequest


def resolve_class(name: str, config: ServiceConfig) -> str:
    name = name or "default"
    if name in config.class_names:
        return name
    if config.strict_classes:
        raise ValueError(f"request_class: unknown class {name!r} (known: {', '.join(config.class_names)})")
    return "default"


def to_engine_request(req: pb.GenerateRequest, config: ServiceConfig, *, stream: bool) -> EngineRequest:
    """Validate a GenerateRequest; ValueError names the field."""
    if req.prompt_token_ids and req.prompt:
        raise ValueError("prompt: give prompt or prompt_token_ids, not both")
    if not req.prompt_token_ids and not req.prompt.strip():
        raise ValueError("prompt: empty prompt")
    if any(t < 0 for t in req.prompt_token_ids):
        raise ValueError("prompt_token_ids: ids must be >= 0")
    max_tokens = req.max_tokens if req.HasField("max_tokens") else config.default_max_tokens
    if not 1 <= max_tokens <= config.max_tokens_limit:
        raise ValueError(f"max_tokens: {max_tokens} is outside 1..{config.max_tokens_limit}")
    temperature = req.temperature if req.HasField("temperature") else 0.0
    if not (temperature >= 0.0 and math.isfinite(temperature)):
        raise ValueError(f"temperature: must be >= 0, got {temperature}")
    top_p = req.top_p if req.HasField("top_p") else 1.0
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
    if req.top_k < 0:
        raise ValueError(f"top_k: must be >= 0, got {req.top_k}")
    if any(not s for s in req.stop):
        raise ValueError("stop: empty stop string")
    arm = None
    if req.HasField("speculation"):
        d, k = req.speculation.drafter or "none", req.speculation.k
        if d not in ("none", *config.drafters):
            raise ValueError(f"speculation.drafter: unknown drafter {d!r} (available: none, "
                             f"{', '.join(config.drafters)})")
        if not 0 <= k <= MAX_K:
            raise ValueError(f"speculation.k: {k} is outside 0..{MAX_K}")
        if d == "none" and k:
            raise ValueError(f"speculation.k: must be 0 with drafter 'none', got {k}")
        arm = Arm(d, k)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                            top_k=int(req.top_k), seed=int(req.seed) if req.HasField("seed") else None,
                            stop=list(req.stop), ignore_eos=req.ignore_eos)
    return EngineRequest(request_id=f"req-{uuid.uuid4().hex[:16]}",
                         request_class=resolve_class(req.request_class, config), params=params,
                         prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids), raw=req.raw, arm=arm,
                         stream=stream)


def _spec_stats(c: EngineChunk) -> pb.SpeculationStats:
    return pb.SpeculationStats(
        drafted=c.drafted, accepted=c.accepted, steps=c.steps,
        acceptance_rate=c.accepted / c.drafted if c.drafted else 0.0,
        mean_accepted_length=c.mean_accepted_length,
        arms=[pb.ArmSteps(arm=a, steps=n) for a, n in sorted(c.arms.items())])


def _usage(c: EngineChunk) -> pb.Usage:
    return pb.Usage(prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens,
                    cached_prompt_tokens=c.cached_prompt_tokens)


def to_response(c: EngineChunk, request_class: str) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=c.request_id, request_class=request_class, text=c.text, token_ids=c.all_token_ids,
        finish_reason=c.finish_reason, usage=_usage(c),
        speculation=_spec_stats(c), timings=pb.Timings(ttft_s=c.ttft_s, e2e_s=c.e2e_s))


def to_chunk(c: EngineChunk, request_class: str) -> pb.GenerateChunk:
    out = pb.GenerateChunk(request_id=c.request_id, token_ids=c.token_ids, text=c.text, finished=c.finished,
                           finish_reason=c.finish_reason, request_class=request_class)
    if c.finished:
        out.usage.CopyFrom(_usage(c))
        out.speculation.CopyFrom(_spec_stats(c))
        out.timings.CopyFrom(pb.Timings(ttft_s=c.ttft_s, e2e_s=c.e2e_s))
    return out


def to_stats(view) -> pb.GetStatsResponse:
    """``view``: a controller ``StatsView``."""
    return pb.GetStatsResponse(
        classes=[pb.ClassStats(request_class=c.request_class, requests=c.requests, drafted=c.drafted,
                               accepted=c.accepted, emitted=c.emitted, steps=c.steps,
                               acceptance_rate=c.acceptance_rate, mean_accepted_length=c.mean_accepted_length,
                               current_arm=c.current_arm, goodput_tokens_per_s=c.goodput_tokens_per_s,
                               pinned=c.pinned) for c in view.classes],
        replicas=[pb.ReplicaStats(replica_id=r.replica_id, batch_size=r.batch_size, num_waiting=r.num_waiting,
                                  step_time_s=r.step_time_s, steps=r.steps, tokens_per_s=r.tokens_per_s,
                                  drafter_faults=r.drafter_faults, in_flight=r.in_flight,
                                  free_slots=r.free_slots) for r in view.replicas],
        policy=view.policy, policy_version=view.version, uptime_s=view.uptime_s, policy_cpu_s=view.policy_cpu_s,
        controller_cpu_s=view.process_cpu_s,
        cost_check=[pb.CostCheckRow(verify_tokens_from=b, verify_tokens_to=b + view.cost_check.bucket - 1, drafted=d,
                                    steps=int(n), predicted_s=p, measured_s=m)
                    for (b, d), (n, p, m) in sorted(view.cost_check.rows.items())] if view.cost_check else [])


def to_policy_state(view) -> pb.PolicyState:
    """``view``: a controller ``PolicyView``."""
    return pb.PolicyState(policy=view.policy, available_policies=list(view.available),
                          classes=[pb.ClassArm(request_class=c, arm=a, pinned=p) for c, a, p in view.classes],
                          version=view.version, drafters=list(view.drafters), max_k=view.max_k)


def to_policy_update(req: pb.UpdatePolicyRequest):
    from adaptspec.serve.controller import PolicyUpdate

    pins = []
    for i, p in enumerate(req.pin):
        d, k = p.arm.drafter or "none", p.arm.k
        if not 0 <= k <= MAX_K:
            raise ValueError(f"pin[{i}].arm.k: {k} is outside 0..{MAX_K}")
        if d not in DRAFTERS:
            raise ValueError(f"pin[{i}].arm.drafter: unknown drafter {d!r}")
        pins.append((p.request_class, Arm(d, k)))
    return PolicyUpdate(req.policy, pins, list(req.unpin), req.reset)
