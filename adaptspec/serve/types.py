"""What crosses deployment boundaries: typed, picklable dataclasses (torch-free).

Ingress methods -> the replica's engine loop: ``EngineRequest``; back: a stream of
``EngineChunk`` (an ``error`` chunk instead of an exception, so the status code survives
Ray's error wrapping); TargetEngine -> Controller: ``ReplicaReport``; Controller ->
TargetEngine: ``PolicySnapshot``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from adaptspec.control.types import NO_SPEC, Arm, StepOutcome
from adaptspec.engine.params import SamplingParams

INVALID_ARGUMENT = "INVALID_ARGUMENT"
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
INTERNAL = "INTERNAL"
UNAVAILABLE = "UNAVAILABLE"


@dataclass(slots=True)
class ErrorInfo:
    code: str  # a grpc.StatusCode name
    message: str  # names the field for INVALID_ARGUMENT


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    request_class: str
    params: SamplingParams
    prompt: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    raw: bool = False
    arm: Arm | None = None  # fixed arm (experiments); None: the controller's snapshot
    stream: bool = False  # compute text deltas per chunk


@dataclass(slots=True)
class EngineChunk:
    request_id: str
    token_ids: list[int] = field(default_factory=list)  # emitted since the last chunk
    text: str = ""  # delta when streaming; the whole text on the final chunk of a unary call
    finished: bool = False
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # final chunk only: prompt tokens the prefix cache served
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    mean_accepted_length: float = 0.0
    arms: dict[str, int] = field(default_factory=dict)  # "drafter:k" -> steps
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    all_token_ids: list[int] = field(default_factory=list)  # final chunk only
    error: ErrorInfo | None = None


@dataclass(slots=True)
class ClassDelta:
    """Per-class counters a replica accumulated since its last report."""

    request_class: str
    requests: int = 0  # finished
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    steps: int = 0


@dataclass(slots=True)
class ReplicaState:
    replica_id: str
    batch_size: int = 0
    num_waiting: int = 0
    step_time_s: float = 0.0
    steps: int = 0
    tokens_per_s: float = 0.0
    drafter_faults: int = 0
    verify_tokens: int = 0
    context_tokens: int = 0
    in_flight: int = 0
    free_slots: int = 0


@dataclass(slots=True)
class ReplicaReport:
    state: ReplicaState
    outcomes: list[StepOutcome] = field(default_factory=list)
    classes: list[ClassDelta] = field(default_factory=list)
    interval_s: float = 0.0


@dataclass(slots=True)
class PolicySnapshot:
    """The arm per class a replica uses until the next snapshot (no RPC per token)."""

    version: int = 0
    arms: dict[str, Arm] = field(default_factory=dict)  # request class -> arm
    default: Arm = NO_SPEC

    def arm_for(self, request_class: str) -> Arm:
        return self.arms.get(request_class, self.arms.get("default", self.default))
