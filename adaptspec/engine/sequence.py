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
    # the paged KV cache (engine.kv_cache): block ids in position order, positions holding
    # committed tokens' KV (len(token_ids) - 1 once the prompt is in), hashes of the leading
    # full blocks and how many of them are registered in the prefix cache
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered: int = 0
    num_cached_tokens: int = 0  # prompt positions reused from the prefix cache at admission
    draft_computed: int = 0  # positions in the draft model's KV
    stats: SpecStats = field(default_factory=SpecStats)
    arrival_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finish_s: float | None = None
    # draft head state: entries in the head's KV, and its normed output at the last entry
    # ([hidden]; the feature the first candidate is drafted from)
    head_fed: int = 0
    head_last: torch.Tensor | None = None

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

    @property
    def prefilling(self) -> bool:
        """Positions before the last token still lack KV (a prompt, or a preempted request)."""
        return self.num_computed < len(self.token_ids) - 1


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
