"""Per-request state inside the engine."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from adaptspec.engine.params import SamplingParams, SpecConfig
from adaptspec.engine.stats import SpecStats


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)  # identity equality: sequences are compared in queues
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    params: SamplingParams
    spec: SpecConfig
    request_class: str
    generator: torch.Generator
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "length" | "stop" | "eos" | "abort"
    slot: int = -1
    num_computed: int = 0  # tokens in the target's KV slot (always len(token_ids) - 1 when running)
    draft_computed: int = 0  # tokens in the draft model's KV slot
    stats: SpecStats = field(default_factory=SpecStats)
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finish_s: float | None = None
    # final hidden states of the target at the last verified positions [n, hidden], for
    # feature-level draft heads; set only when a proposer asks for them
    last_hidden: torch.Tensor | None = None
    # draft head state: entries in the head's KV slot, and target features not fed to it yet
    head_computed: int = 0
    head_pending: list = field(default_factory=list)  # [m_i, hidden] tensors, contiguous positions
    head_pending_from: int = 0  # position of the first pending feature
    head_broken: bool = False  # a gap in the features: this sequence cannot use the head

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - self.num_output_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(slots=True)
class RequestOutput:
    """What a step (or ``generate``) hands back for one request."""

    request_id: str
    new_token_ids: list[int]  # emitted by this step
    token_ids: list[int]  # all output tokens so far
    finished: bool
    finish_reason: str | None
    text: str = ""
    stats: SpecStats | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    e2e_s: float | None = None
