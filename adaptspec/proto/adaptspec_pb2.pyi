from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Arm(_message.Message):
    __slots__ = ("drafter", "k")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    k: int
    def __init__(self, drafter: _Optional[str] = ..., k: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "raw", "request_class", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "speculation", "ignore_eos")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    raw: bool
    request_class: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    speculation: Arm
    ignore_eos: bool
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., raw: _Optional[bool] = ..., request_class: _Optional[str] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., speculation: _Optional[_Union[Arm, _Mapping]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class ArmSteps(_message.Message):
    __slots__ = ("arm", "steps")
    ARM_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    arm: str
    steps: int
    def __init__(self, arm: _Optional[str] = ..., steps: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("drafted", "accepted", "steps", "acceptance_rate", "mean_accepted_length", "arms")
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ARMS_FIELD_NUMBER: _ClassVar[int]
    drafted: int
    accepted: int
    steps: int
    acceptance_rate: float
    mean_accepted_length: float
    arms: _containers.RepeatedCompositeFieldContainer[ArmSteps]
    def __init__(self, drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., steps: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., arms: _Optional[_Iterable[_Union[ArmSteps, _Mapping]]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("ttft_s", "e2e_s")
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    ttft_s: float
    e2e_s: float
    def __init__(self, ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "request_class", "text", "token_ids", "finish_reason", "usage", "speculation", "timings")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    request_class: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: Usage
    speculation: SpeculationStats
    timings: Timings
    def __init__(self, request_id: _Optional[str] = ..., request_class: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationStats, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finished", "finish_reason", "usage", "speculation", "timings", "request_class")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    usage: Usage
    speculation: SpeculationStats
    timings: Timings
    request_class: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationStats, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., request_class: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClassStats(_message.Message):
    __slots__ = ("request_class", "requests", "drafted", "accepted", "emitted", "steps", "acceptance_rate", "mean_accepted_length", "current_arm", "goodput_tokens_per_s", "pinned")
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    EMITTED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ARM_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    request_class: str
    requests: int
    drafted: int
    accepted: int
    emitted: int
    steps: int
    acceptance_rate: float
    mean_accepted_length: float
    current_arm: str
    goodput_tokens_per_s: float
    pinned: bool
    def __init__(self, request_class: _Optional[str] = ..., requests: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., emitted: _Optional[int] = ..., steps: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., current_arm: _Optional[str] = ..., goodput_tokens_per_s: _Optional[float] = ..., pinned: _Optional[bool] = ...) -> None: ...

class ReplicaStats(_message.Message):
    __slots__ = ("replica_id", "batch_size", "num_waiting", "step_time_s", "steps", "tokens_per_s", "drafter_faults", "in_flight", "free_slots")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FAULTS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    batch_size: int
    num_waiting: int
    step_time_s: float
    steps: int
    tokens_per_s: float
    drafter_faults: int
    in_flight: int
    free_slots: int
    def __init__(self, replica_id: _Optional[str] = ..., batch_size: _Optional[int] = ..., num_waiting: _Optional[int] = ..., step_time_s: _Optional[float] = ..., steps: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., drafter_faults: _Optional[int] = ..., in_flight: _Optional[int] = ..., free_slots: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("classes", "replicas", "policy", "policy_version", "uptime_s", "policy_cpu_s", "controller_cpu_s", "cost_check")
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    POLICY_CPU_S_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_CPU_S_FIELD_NUMBER: _ClassVar[int]
    COST_CHECK_FIELD_NUMBER: _ClassVar[int]
    classes: _containers.RepeatedCompositeFieldContainer[ClassStats]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStats]
    policy: str
    policy_version: int
    uptime_s: float
    policy_cpu_s: float
    controller_cpu_s: float
    cost_check: _containers.RepeatedCompositeFieldContainer[CostCheckRow]
    def __init__(self, classes: _Optional[_Iterable[_Union[ClassStats, _Mapping]]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStats, _Mapping]]] = ..., policy: _Optional[str] = ..., policy_version: _Optional[int] = ..., uptime_s: _Optional[float] = ..., policy_cpu_s: _Optional[float] = ..., controller_cpu_s: _Optional[float] = ..., cost_check: _Optional[_Iterable[_Union[CostCheckRow, _Mapping]]] = ...) -> None: ...

class CostCheckRow(_message.Message):
    __slots__ = ("verify_tokens_from", "verify_tokens_to", "drafted", "steps", "predicted_s", "measured_s")
    VERIFY_TOKENS_FROM_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TOKENS_TO_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_S_FIELD_NUMBER: _ClassVar[int]
    MEASURED_S_FIELD_NUMBER: _ClassVar[int]
    verify_tokens_from: int
    verify_tokens_to: int
    drafted: bool
    steps: int
    predicted_s: float
    measured_s: float
    def __init__(self, verify_tokens_from: _Optional[int] = ..., verify_tokens_to: _Optional[int] = ..., drafted: _Optional[bool] = ..., steps: _Optional[int] = ..., predicted_s: _Optional[float] = ..., measured_s: _Optional[float] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClassArm(_message.Message):
    __slots__ = ("request_class", "arm", "pinned")
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    ARM_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    request_class: str
    arm: str
    pinned: bool
    def __init__(self, request_class: _Optional[str] = ..., arm: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class PolicyState(_message.Message):
    __slots__ = ("policy", "available_policies", "classes", "version", "drafters", "max_k")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_POLICIES_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    policy: str
    available_policies: _containers.RepeatedScalarFieldContainer[str]
    classes: _containers.RepeatedCompositeFieldContainer[ClassArm]
    version: int
    drafters: _containers.RepeatedScalarFieldContainer[str]
    max_k: int
    def __init__(self, policy: _Optional[str] = ..., available_policies: _Optional[_Iterable[str]] = ..., classes: _Optional[_Iterable[_Union[ClassArm, _Mapping]]] = ..., version: _Optional[int] = ..., drafters: _Optional[_Iterable[str]] = ..., max_k: _Optional[int] = ...) -> None: ...

class Pin(_message.Message):
    __slots__ = ("request_class", "arm")
    REQUEST_CLASS_FIELD_NUMBER: _ClassVar[int]
    ARM_FIELD_NUMBER: _ClassVar[int]
    request_class: str
    arm: Arm
    def __init__(self, request_class: _Optional[str] = ..., arm: _Optional[_Union[Arm, _Mapping]] = ...) -> None: ...

class UpdatePolicyRequest(_message.Message):
    __slots__ = ("policy", "pin", "unpin", "reset")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    UNPIN_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    policy: str
    pin: _containers.RepeatedCompositeFieldContainer[Pin]
    unpin: _containers.RepeatedScalarFieldContainer[str]
    reset: bool
    def __init__(self, policy: _Optional[str] = ..., pin: _Optional[_Iterable[_Union[Pin, _Mapping]]] = ..., unpin: _Optional[_Iterable[str]] = ..., reset: _Optional[bool] = ...) -> None: ...
