"""SLO-aware admission: refuse at once a request that cannot meet its class's TTFT target.

Past capacity a queue grows without end and every request in it misses its TTFT (goodput
0 for every arm, static or adaptive). A request refused at once can be retried elsewhere;
one queued to fail helps nobody and delays everyone behind it. The rule: a request of a
class with a TTFT target is admitted when the predicted wait for its first token,

    (prompt tokens queued ahead of it + its own) / (prompt tokens the replica processes per second),

is within ``slack`` x its target. The service rate is measured, not assumed: prompt tokens
processed per second of steps that left prompt work waiting (steps that were not waiting
for work, where the rate is the replica's and not the arrivals'). Until such a step has been
seen everything is admitted. Classes without a TTFT target are always admitted.

Ray-free and engine-free: the simulator's replica and the service's engine loop use it.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SloAdmission:
    ttft_s: dict[str, float]  # request class -> TTFT target (classes absent: no admission control)
    # the predicted wait is a mean: admitting up to the whole target lets about half of the
    # requests at the edge miss it (simulations/REPORT.md, overload-2x)
    slack: float = 0.8
    half_life_s: float = 5.0  # seconds of backlogged steps over which the rate estimate forgets
    _tokens: float = field(init=False, default=0.0)  # discounted prompt tokens processed
    _seconds: float = field(init=False, default=0.0)  # discounted seconds of those steps
    refused: dict[str, int] = field(init=False, default_factory=dict)
    admitted: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not self.slack > 0:
            raise ValueError(f"slack: must be > 0, got {self.slack}")
        for c, t in self.ttft_s.items():
            if not t > 0:
                raise ValueError(f"ttft_s[{c!r}]: must be > 0, got {t}")

    @property
    def rate(self) -> float | None:
        """Prompt tokens per second the replica processes while work waits (None: not seen yet)."""
        return self._tokens / self._seconds if self._seconds > 0 and self._tokens > 0 else None

    def observe(self, wall_s: float, prompt_tokens: int, backlog_left: bool) -> None:
        """One step: its seconds, the prompt tokens it processed, and whether prompt work was
        still waiting after it (only such steps measure the rate)."""
        if not backlog_left or wall_s <= 0:
            return
        g = 0.5 ** (wall_s / self.half_life_s)
        self._tokens = g * self._tokens + prompt_tokens
        self._seconds = g * self._seconds + wall_s

    def predicted_wait(self, prompt_tokens: int, backlog_tokens: float) -> float:
        r = self.rate
        return 0.0 if r is None else (backlog_tokens + prompt_tokens) / r

    def admit(self, request_class: str, prompt_tokens: int, backlog_tokens: float) -> bool:
        """True to admit; False: refuse now (the caller answers RESOURCE_EXHAUSTED)."""
        target = self.ttft_s.get(request_class)
        if target is None or backlog_tokens <= 0 or self.predicted_wait(prompt_tokens, backlog_tokens) <= self.slack * target:
            self.admitted += 1
            return True
        self.refused[request_class] = self.refused.get(request_class, 0) + 1
        return False
