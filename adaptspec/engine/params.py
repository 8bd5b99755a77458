"""User-facing request parameters, validated at the edge (ValueError names the field)."""
from __future__ import annotations

from dataclasses import dataclass, field

DRAFTERS = ("none", "ngram", "draft", "suffix")
MAX_K = 16


GREEDY_BELOW = 1e-5  # temperatures under this are greedy: logits / 1e-38 overflow to inf, then NaN


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request. ``temperature`` 0 (or below ``GREEDY_BELOW``, its limit) is greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None  # per-request torch.Generator; None: a random seed
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(slots=True)
class SpecConfig:
    """The arm a request runs with: which drafter proposes and how many candidates ``k``.

    ``k == 0`` (or drafter ``none``) is plain decoding through the same engine.
    """

    drafter: str = "none"
    k: int = 0
    # per-token draft stopping: drafting stops at the first candidate whose drafter
    # confidence (the draft's probability of it) is below this; 0 drafts all k
    min_confidence: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.min_confidence, (int, float)) or not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {self.min_confidence!r}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if not isinstance(self.k, int) or not 0 <= self.k <= MAX_K:
            raise ValueError(f"k must be an integer in 0..{MAX_K}, got {self.k!r}")
        if self.drafter == "none" and self.k != 0:
            raise ValueError(f"k must be 0 with drafter 'none', got {self.k}")

    @property
    def speculates(self) -> bool:
        return self.drafter != "none" and self.k > 0
