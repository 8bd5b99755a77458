"""Acceptance recorded from the live engine, replayed by the simulator.

Recording: ``AcceptanceRecorder.observe_step`` takes the engine's per-step stats (an engine
``StepStats``: listen with ``Engine.step_listeners``) and counts, per request class and
drafter, how many drafted tokens each request-step kept, by the ``k`` it asked for (a
histogram over 0..k). A step whose n-gram lookup found fewer candidates than asked counts
as proposed and rejected past what it found: the simulator drafts ``k`` and needs the
acceptance of asking for ``k``. When the engine reports the drafter's confidence in each
drafted token (``RequestStepStats.draft_confidence``, a probability per drafted position),
the recorder also counts tried and accepted tokens per confidence bin, for a model of
acceptance given confidence.

Replay: ``RecordedAcceptance`` samples accepted counts from the histogram recorded at the
``k`` asked for when it holds enough request-steps (it keeps what a per-position model
loses: n-gram's all-or-nothing misses, runs of easy tokens), else from the conditional
acceptance per position pooled over every recorded ``k`` (a position ``j`` was tried by a
request-step that drafted it after accepting the ``j - 1`` before it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

CONFIDENCE_EDGES = tuple(round(0.1 * i, 1) for i in range(11))


class ConfidenceCounts(BaseModel):
    model_config = ConfigDict(extra="forbid")

    edges: list[float] = Field(description="bin edges of the drafter's probability of its token")
    tried: list[int] = Field(description="drafted tokens the verifier reached, per bin")
    accepted: list[int] = Field(description="of those, accepted, per bin")


class DrafterRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    by_k: dict[int, list[int]] = Field(description="k asked for -> request-steps by accepted count 0..k")
    drafted: dict[int, int] = Field(default_factory=dict, description="k -> drafted tokens in all (n-gram may "
                                                                      "propose fewer than k)")
    confidence: ConfidenceCounts | None = Field(None, description="acceptance by draft confidence, when the "
                                                                  "engine reports it")


class AcceptanceFile(BaseModel):
    """An acceptance recording (JSON): class -> drafter -> counts."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(1, description="format version")
    source: str = Field("", description="what was recorded (models, machine, date)")
    classes: dict[str, dict[str, DrafterRecord]] = Field(description="request class -> drafter -> counts")

    @classmethod
    def load(cls, path: str | Path) -> "AcceptanceFile":
        try:
            return cls.model_validate(json.loads(Path(path).read_text()))
        except (ValidationError, json.JSONDecodeError) as e:
            raise ValueError(f"acceptance recording {path}: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.model_dump(), indent=1))


@dataclass(slots=True)
class _Counts:
    by_k: dict[int, np.ndarray] = field(default_factory=dict)
    drafted: dict[int, int] = field(default_factory=dict)
    conf_tried: np.ndarray = field(default_factory=lambda: np.zeros(len(CONFIDENCE_EDGES) - 1, dtype=np.int64))
    conf_accepted: np.ndarray = field(default_factory=lambda: np.zeros(len(CONFIDENCE_EDGES) - 1, dtype=np.int64))
    has_confidence: bool = False


class AcceptanceRecorder:
    """Counts accepted drafted tokens per (class, drafter, k) from engine step stats."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], _Counts] = {}
        self.steps = 0

    def observe_step(self, step) -> None:
        """``step``: an engine ``StepStats`` (its ``requests`` carry class, drafter, k, drafted, accepted)."""
        self.steps += 1
        for r in step.requests:
            if r.drafter == "none" or r.k <= 0:
                continue
            self.observe(r.request_class, r.drafter, r.k, r.drafted, r.accepted,
                         getattr(r, "draft_confidence", None))

    def observe(self, request_class: str, drafter: str, k: int, drafted: int, accepted: int,
                confidence=None) -> None:
        c = self._counts.setdefault((request_class, drafter), _Counts())
        hist = c.by_k.get(k)
        if hist is None:
            hist = c.by_k[k] = np.zeros(k + 1, dtype=np.int64)
        hist[min(max(accepted, 0), k)] += 1
        c.drafted[k] = c.drafted.get(k, 0) + drafted
        if confidence is not None and len(confidence):
            c.has_confidence = True
            conf = np.clip(np.asarray(confidence, dtype=float)[: max(drafted, 0)], 0.0, 1.0)
            tried = conf[: accepted + 1]  # the verifier reached these: all accepted and the first rejected one
            bins = np.minimum(np.searchsorted(CONFIDENCE_EDGES, tried, side="right") - 1, len(CONFIDENCE_EDGES) - 2)
            np.add.at(c.conf_tried, bins, 1)
            np.add.at(c.conf_accepted, bins[: accepted], 1)

    def to_file(self, source: str = "") -> AcceptanceFile:
        classes: dict[str, dict[str, DrafterRecord]] = {}
        for (cls, drafter), c in sorted(self._counts.items()):
            conf = None
            if c.has_confidence:
                conf = ConfidenceCounts(edges=list(CONFIDENCE_EDGES), tried=c.conf_tried.tolist(),
                                        accepted=c.conf_accepted.tolist())
            classes.setdefault(cls, {})[drafter] = DrafterRecord(
                by_k={k: h.tolist() for k, h in sorted(c.by_k.items())}, drafted=dict(sorted(c.drafted.items())),
                confidence=conf)
        return AcceptanceFile(source=source, classes=classes)


def pooled_positions(by_k: dict[int, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(tried, accepted) per position 1..max k, over every recorded k: position j was tried by
    a request-step that asked for k >= j and accepted the j - 1 before it."""
    K = max(by_k, default=0)
    tried, acc = np.zeros(K), np.zeros(K)
    for k, hist in by_k.items():
        hist = np.asarray(hist, dtype=float)
        tail = np.cumsum(hist[::-1])[::-1]  # tail[a] = request-steps with accepted >= a
        tried[:k] += tail[:k]
        acc[:k] += tail[1: k + 1]
    return tried, acc


@dataclass(slots=True)
class RecordedAcceptance:
    """Replays a recording: the histogram at the asked ``k`` when it has ``min_steps``
    request-steps, else the pooled conditional acceptance per position (the last position
    with data repeats)."""

    by_k: dict[int, np.ndarray]
    min_steps: int = 30
    _probs: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.by_k = {int(k): np.asarray(h, dtype=np.int64) for k, h in self.by_k.items() if np.sum(h) > 0}
        for k, h in self.by_k.items():
            if k < 1 or h.size != k + 1 or np.any(h < 0):
                raise ValueError(f"by_k[{k}]: needs k + 1 non-negative counts (accepted 0..k), got {h.tolist()}")
        tried, acc = pooled_positions(self.by_k)
        known = tried > 0
        p = np.divide(acc, tried, out=np.zeros_like(tried), where=known)
        # positions past the deepest one with data repeat it
        if known.any():
            last = int(np.flatnonzero(known)[-1])
            p = p[: last + 1]
        else:
            p = np.zeros(1)
        self._probs = p

    @classmethod
    def from_record(cls, rec: DrafterRecord, min_steps: int = 30) -> "RecordedAcceptance":
        return cls({k: np.array(v) for k, v in rec.by_k.items()}, min_steps)

    @property
    def steps(self) -> int:
        return int(sum(h.sum() for h in self.by_k.values()))

    def position_probs(self, K: int) -> np.ndarray:
        p = self._probs
        return p[:K] if p.size >= K else np.concatenate([p, np.full(K - p.size, p[-1])])

    def sample(self, k: int, n: int, rng: np.random.Generator) -> np.ndarray:
        hist = self.by_k.get(k)
        if hist is not None and hist.sum() >= self.min_steps:
            return rng.choice(k + 1, size=n, p=hist / hist.sum())
        ok = rng.random((n, k)) < self.position_probs(k)
        return np.cumprod(ok, axis=1).sum(axis=1)


def recorded_model(spec, base: Path, where: str, request_class: str | None, drafter: str | None) -> RecordedAcceptance:
    """The model a scenario's ``acceptance: {recorded: ...}`` names (a ``RecordedSpec``)."""
    path = Path(spec.file) if Path(spec.file).is_absolute() else base / spec.file
    if not path.exists():
        raise ValueError(f"{where}.file: {path} does not exist")
    data = AcceptanceFile.load(path)
    cls, d = spec.request_class or request_class, spec.drafter or drafter
    rec = data.classes.get(cls, {}).get(d)
    if rec is None:
        have = [f"{c}/{x}" for c, per in data.classes.items() for x in per]
        raise ValueError(f"{where}: {path} has no recording of class {cls!r} with drafter {d!r} (it has {have})")
    model = RecordedAcceptance.from_record(rec, spec.min_steps)
    if model.steps == 0:
        raise ValueError(f"{where}: {path} holds no request-steps of class {cls!r} with drafter {d!r}")
    return model
