"""Speculation statistics: one place, consumed by logs, metrics, the controller and the simulator.

Words as in the glossary: **drafted** tokens proposed, **accepted** drafted tokens kept,
**emitted** tokens appended by a step (accepted + the recovered or bonus token, fewer when
the request stopped inside the step), **accepted length** = emitted per step.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from adaptspec.engine.params import MAX_K


@dataclass(slots=True)
class RequestStepStats:
    """What one request did in one speculative step."""

    request_id: str
    request_class: str
    drafter: str
    k: int  # candidates asked for this step: the arm's k, clamped to the tokens the request has left
    drafted: int  # candidates actually proposed (n-gram may find fewer)
    accepted: int  # drafted tokens kept (none past an EOS or a stop string that ended the request)
    emitted: int
    draft_confidence: list[float] = field(default_factory=list)  # [drafted] the drafter's probability of each
    # output tokens the request had before this step (-1: not known). Under greedy decoding what a
    # drafter proposes there and what the target keeps are a property of the prompt and this
    # position, which is what lets the simulator replay a request step by step
    position: int = -1
    min_confidence: float = 0.0  # the draft-stopping threshold the request's arm drafted under


@dataclass(slots=True)
class StepStats:
    """One engine step. Times are seconds measured around each phase by the host clock,
    except on CUDA the forward's (``prefill_s + verify_s``): the GPU's time between two
    events around the forward and verification kernels (``ForwardTimer``)."""

    step: int
    batch_size: int  # requests in the verification pass
    num_prefill: int  # requests prefilled this step
    prefill_tokens: int
    verify_tokens: int  # tokens in the one batched target pass (sum of k_i + 1)
    context_tokens: int  # tokens already cached across the batch before the pass
    num_waiting: int
    prefill_s: float
    draft_s: float
    verify_s: float
    other_s: float
    wall_s: float
    requests: list[RequestStepStats] = field(default_factory=list)
    # perf_counter at the step's end (the host's): CLOCK_MONOTONIC on Linux, one clock for every
    # process of the host, so an engine process's steps line up with a client's request times
    end_s: float = 0.0
    unfinished: int = 0  # requests running or waiting once the step is done (0: the engine went idle)
    # the step's prompt work was cut by TPOT-paced prefill (``Engine.pacer``): whoever waits was
    # held back by choice, not for lack of capacity (the controller and admission read no queue)
    prompts_held: bool = False

    @property
    def backlog(self) -> int:
        """Requests waiting for lack of capacity: ``num_waiting``, 0 when the pacer held them."""
        return 0 if self.prompts_held else self.num_waiting

    @property
    def emitted(self) -> int:
        return sum(r.emitted for r in self.requests)


@dataclass(slots=True)
class SpecStats:
    """Cumulative speculation counters, for one request or aggregated over many."""

    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    steps: int = 0  # speculative (verification) steps taken
    accepted_per_position: list[int] = field(default_factory=lambda: [0] * MAX_K)
    drafted_per_position: list[int] = field(default_factory=lambda: [0] * MAX_K)
    arms: Counter = field(default_factory=Counter)  # "drafter:k" -> steps
    wall_s: float = 0.0
    cached_prompt_tokens: int = 0  # prompt positions reused from the prefix cache (one request)

    def observe_step(self, r: RequestStepStats) -> None:
        self.drafted += r.drafted
        self.accepted += r.accepted
        self.emitted += r.emitted
        self.steps += 1
        for j in range(r.drafted):
            self.drafted_per_position[j] += 1
        for j in range(r.accepted):
            self.accepted_per_position[j] += 1
        self.arms[f"{r.drafter}:{r.k}"] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step (accepted + 1 on average)."""
        return self.emitted / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        last = max((j + 1 for j, d in enumerate(self.drafted_per_position) if d), default=0)
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "steps": self.steps,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "accepted_per_position": self.accepted_per_position[:last],
            "drafted_per_position": self.drafted_per_position[:last],
            "arms": dict(self.arms),
            "wall_s": round(self.wall_s, 4),
            "cached_prompt_tokens": self.cached_prompt_tokens,
        }


class ForwardTimer:
    """The forward's time for ``StepStats`` on CUDA, from a pair of CUDA events (the CPU
    keeps ``time.perf_counter`` and uses no timer).

    ``start`` before the step's first launch; ``stop`` just before the step's one
    device-to-host transfer (or at the step's end when it has none), so that the transfer,
    which waits for the forward anyway, also completes the events: reading them then costs
    no sync. A step without a transfer (prompt chunks only) is read one step later, once
    the next step's transfer has run. A host clock would charge such a step's GPU time to
    the next one. Events come from a small ring, nothing is allocated per step."""

    RING = 4  # steps in flight at most: the current one and the one before

    def __init__(self):
        import torch

        self._pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                       for _ in range(self.RING)]
        self._i, self._stopped = 0, True

    def start(self) -> None:
        self._i = (self._i + 1) % self.RING
        self._pairs[self._i][0].record()  # on the current stream, where the forward runs
        self._stopped = False

    def stop(self) -> None:
        if not self._stopped:
            self._pairs[self._i][1].record()
            self._stopped = True

    def lap(self) -> "Lap":
        """This step's measurement (stopped now if it was not)."""
        self.stop()
        return Lap(*self._pairs[self._i])


class Lap:
    def __init__(self, start, end):
        self.start, self.end = start, end

    def ready(self) -> bool:
        return self.end.query()

    def seconds(self) -> float:
        """Elapsed seconds; waits for the end event if it has not run yet."""
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3
