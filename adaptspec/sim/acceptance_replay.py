"""Acceptance recorded from the live engine, replayed by the simulator.

Recording: ``AcceptanceRecorder.observe_step`` takes the engine's per-step stats (an engine
``StepStats``: listen with ``Engine.step_listeners``) and counts, per request class,
drafter and the ``k`` asked for, request-steps by (candidates proposed m, of them accepted
j): a ``[k + 1, k + 1]`` matrix ``H[m, j]``, the form ``GroupOutcome.drafted_accepted``
has. n-gram lookup proposes fewer than ``k`` when its match runs out (often none at all);
a draft model proposes ``k`` unless a confidence threshold stops it. When the engine
reports the drafter's confidence in each drafted token (``draft_confidence``), the
recorder also counts, per confidence bin, tokens seen per position (drafting without a
threshold only) and verified tokens accepted and rejected (up to the first rejection),
as ``control.types.ConfidenceCounts`` does.

Replay: ``RecordedAcceptance`` has two views of the same recording.

- ``sample(k, n, rng)``: accepted tokens when asking for ``k`` (a candidate never proposed
  counts as rejected): what a simulator that always verifies ``k`` candidates needs.
  From the histogram recorded at that ``k`` when it holds ``min_steps`` request-steps,
  else from the conditional acceptance per position pooled over every recorded ``k``.
- ``sample_proposed(k, n, rng)``: (proposed, accepted) pairs: resampled from ``H`` at
  that ``k``, else drawn position by position from the pooled chance that a candidate is
  there (given the ones before it were) and the pooled acceptance of a proposed candidate
  (given the ones before it were accepted; a request that proposed m and kept all m is
  censored at m + 1, never counted as a rejection there).
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

CONF_BINS = 10  # equal bins of [0, 1], as control.types


class ConfidenceRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seen: list[list[int]] = Field(description="[position][bin] drafted tokens by confidence (no threshold)")
    accepted: list[int] = Field(description="[bin] verified tokens accepted")
    rejected: list[int] = Field(description="[bin] verified tokens rejected (the first rejection of a step)")


class DrafterRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    joint: dict[int, list[list[int]]] = Field(description="k asked for -> H[m][j]: request-steps that proposed m "
                                                          "candidates and kept j of them")
    confidence: ConfidenceRecord | None = Field(None, description="by draft confidence, when the engine reports it")
    by_prompt: dict[int, dict[int, list[list[int]]]] | None = Field(
        None, description="prompt (index in its class's prompt pool) -> k asked for -> H[m][j], when the recorder "
                          "knew each request's prompt")
    by_position: dict[int, dict[int, list[int]]] | None = Field(
        None, description="prompt -> output position (tokens the request had generated before the step) -> [k "
                          "asked for, proposed, kept] seen there, when the recorder knew both (greedy decoding: "
                          "a property of the prompt and the position)")

    def accepted_hist(self, k: int) -> np.ndarray:
        return np.asarray(self.joint[k], dtype=np.int64).sum(axis=0)


class AcceptanceFile(BaseModel):
    """An acceptance recording (JSON): class -> drafter -> counts."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(2, description="format version")
    source: str = Field("", description="what was recorded (models, machine, date)")
    classes: dict[str, dict[str, DrafterRecord]] = Field(description="request class -> drafter -> counts")

    @classmethod
    def load(cls, path: str | Path) -> "AcceptanceFile":
        """The recording at ``path``; gzipped where the name ends in ``.gz`` (how the results
        folders keep the large ones)."""
        from adaptspec.sim.report import read_json_file  # here: report imports the simulator, which imports this

        try:
            return cls.model_validate(read_json_file(path))
        except (ValidationError, json.JSONDecodeError, gzip.BadGzipFile) as e:
            raise ValueError(f"acceptance recording {path}: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.model_dump(), indent=1))


@dataclass(slots=True)
class _Counts:
    joint: dict[int, np.ndarray] = field(default_factory=dict)
    by_prompt: dict[int, dict[int, np.ndarray]] = field(default_factory=dict)
    by_position: dict[int, dict[int, tuple[int, int, int]]] = field(default_factory=dict)
    seen: np.ndarray | None = None  # [positions, bins]
    accepted: np.ndarray = field(default_factory=lambda: np.zeros(CONF_BINS, dtype=np.int64))
    rejected: np.ndarray = field(default_factory=lambda: np.zeros(CONF_BINS, dtype=np.int64))


def _bins(c) -> np.ndarray:
    return np.minimum((np.clip(np.asarray(c, dtype=float), 0.0, 1.0) * CONF_BINS).astype(np.int64), CONF_BINS - 1)


def settled(k: int, m: int, j: int) -> bool:
    """Whether a step that asked for ``k``, got ``m`` proposed and kept ``j`` says what any
    ``k`` would have kept there: the proposals ran out (m < k) or one was rejected (j < m)."""
    return m < k or j < m


def _telling(k: int, m: int, j: int) -> tuple[int, int, int]:
    """How much a step says of any other k's step at its position, as a sort key: settled
    (what is kept) first, then whether the proposals ran out (how many any k gets proposed),
    then how deep it asked (proposals seen that far)."""
    return int(settled(k, m, j)), int(m < k), k


def _keep_trace(trace: dict[int, tuple[int, int, int]], pos: int, k: int, m: int, j: int) -> None:
    """Keep the most telling step seen at ``pos`` (``_telling``): a settled one over a censored
    one; of two settled ones, one whose drafter ran out, else the deeper k (a static k = 4 run's
    rejection says nothing of how many an n-gram drafter proposes at k = 8; the adaptive run's
    step there at k = 8 does). An equal one does not replace the first."""
    old = trace.get(pos)
    if old is None or _telling(k, m, j) > _telling(*old):
        trace[pos] = (k, m, j)


def _count(joint: dict[int, np.ndarray], k: int, m: int, j: int) -> None:
    h = joint.get(k)
    if h is None:
        h = joint[k] = np.zeros((k + 1, k + 1), dtype=np.int64)
    h[m, j] += 1


class AcceptanceRecorder:
    """Counts (proposed, accepted) per (class, drafter, k) from engine step stats.

    ``prompt_of``: request id -> the index of its prompt in its class's prompt pool (None:
    unknown). With it the counts are also kept per prompt: acceptance is a property of the
    text more than of its class (n-gram lookup keeps 2-3 tokens a step on a prompt whose
    answer copies it and none on the next), and a replay that gives every request its class's
    mean acceptance makes every request alike, which moves the median TPOT though not the
    mean throughput."""

    def __init__(self, prompt_of=None) -> None:
        self._counts: dict[tuple[str, str], _Counts] = {}
        self.steps = 0
        self.prompt_of = prompt_of

    def observe_step(self, step) -> None:
        """``step``: an engine ``StepStats`` (its ``requests`` carry class, drafter, k, drafted,
        accepted, the request's output ``position`` and, when the drafter gives them,
        ``draft_confidence``)."""
        self.steps += 1
        for r in step.requests:
            if r.drafter == "none" or r.k <= 0:
                continue
            self.observe(r.request_class, r.drafter, r.k, r.drafted, r.accepted,
                         getattr(r, "draft_confidence", None) or None,
                         float(getattr(r, "min_confidence", 0.0) or 0.0),
                         prompt=None if self.prompt_of is None else self.prompt_of(r.request_id),
                         position=getattr(r, "position", -1))

    def observe(self, request_class: str, drafter: str, k: int, drafted: int, accepted: int,
                confidence=None, threshold: float = 0.0, prompt: int | None = None,
                position: int | None = None) -> None:
        """``position``: the request's output tokens before the step; kept per prompt
        (``DrafterRecord.by_position``) when the drafter ran without a confidence threshold
        (one stops the draft where another threshold would not)."""
        c = self._counts.setdefault((request_class, drafter), _Counts())
        m = min(max(drafted, 0), k)
        j = min(max(accepted, 0), m)
        _count(c.joint, k, m, j)
        if prompt is not None and prompt >= 0:
            _count(c.by_prompt.setdefault(int(prompt), {}), k, m, j)
            if position is not None and position >= 0 and threshold <= 0:
                _keep_trace(c.by_position.setdefault(int(prompt), {}), int(position), k, m, j)
        if confidence is not None and m > 0:
            b = _bins(list(confidence)[:m])
            if threshold <= 0:
                if c.seen is None or c.seen.shape[0] < b.size:
                    grown = np.zeros((max(b.size, 0 if c.seen is None else c.seen.shape[0]), CONF_BINS), dtype=np.int64)
                    if c.seen is not None:
                        grown[: c.seen.shape[0]] = c.seen
                    c.seen = grown
                c.seen[np.arange(b.size), b] += 1
            j = min(accepted, b.size)
            np.add.at(c.accepted, b[:j], 1)
            if j < b.size:
                c.rejected[b[j]] += 1

    def to_file(self, source: str = "") -> AcceptanceFile:
        classes: dict[str, dict[str, DrafterRecord]] = {}
        for (cls, drafter), c in sorted(self._counts.items()):
            conf = None
            if c.seen is not None or c.accepted.any() or c.rejected.any():
                conf = ConfidenceRecord(seen=[] if c.seen is None else c.seen.tolist(), accepted=c.accepted.tolist(),
                                        rejected=c.rejected.tolist())
            by_prompt = {p: {k: h.tolist() for k, h in sorted(j.items())} for p, j in sorted(c.by_prompt.items())}
            by_position = {p: {t: list(x) for t, x in sorted(tr.items())} for p, tr in sorted(c.by_position.items())}
            classes.setdefault(cls, {})[drafter] = DrafterRecord(
                joint={k: h.tolist() for k, h in sorted(c.joint.items())}, confidence=conf, by_prompt=by_prompt or None,
                by_position=by_position or None)
        return AcceptanceFile(source=source, classes=classes)


def pooled_positions(by_k: dict[int, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(tried, accepted) per position 1..max k of asking for k, over every recorded k: position
    j was tried by a request-step that asked for k >= j and accepted the j - 1 before it
    (proposed or not: a candidate never proposed is not accepted)."""
    K = max(by_k, default=0)
    tried, acc = np.zeros(K), np.zeros(K)
    for k, hist in by_k.items():
        tail = np.cumsum(np.asarray(hist, dtype=float)[::-1])[::-1]  # tail[a]: accepted >= a
        tried[:k] += tail[:k]
        acc[:k] += tail[1: k + 1]
    return tried, acc


def pooled_proposals(joint: dict[int, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per position p = 1..max k, over every recorded k: (asked, there) - request-steps that
    asked for k >= p and proposed p - 1 or more, and of them those that proposed p or more;
    (tried, kept) - request-steps that proposed p or more and kept the p - 1 before it, and of
    them those that kept p (censored: one that proposed m < p says nothing of position p)."""
    K = max(joint, default=0)
    asked, there, tried, kept = (np.zeros(K) for _ in range(4))
    for k, h in joint.items():
        h = np.asarray(h, dtype=float)
        proposed_ge = np.cumsum(h.sum(axis=1)[::-1])[::-1]  # [k + 1]: proposed >= m
        asked[:k] += proposed_ge[:k]
        there[:k] += proposed_ge[1: k + 1]
        for p in range(1, k + 1):
            rows = h[p:]  # proposed >= p
            tried[p - 1] += rows[:, p - 1:].sum()
            kept[p - 1] += rows[:, p:].sum()
    return asked, there, tried, kept


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den per position, cut after the deepest position with data (that one repeats)."""
    known = den > 0
    p = np.divide(num, den, out=np.zeros_like(den, dtype=float), where=known)
    return p[: int(np.flatnonzero(known)[-1]) + 1] if known.any() else np.zeros(1)


def _extend(p: np.ndarray, K: int) -> np.ndarray:
    return p[:K] if p.size >= K else np.concatenate([p, np.full(K - p.size, p[-1])])


@dataclass(slots=True)
class RecordedAcceptance:
    """Replays a recording (see the module's docstring): ``joint[k] = H[m, j]``.

    ``by_prompt``: the same per prompt (its index in the class's prompt pool). Given each
    request's prompt, a request whose prompt holds ``min_steps`` request-steps at the k asked
    for, or as many over k's up to it or deeper (pooled over them), is replayed from its own
    recording, any other from the class's.
    ``trace``: per prompt, per output position, the step seen there live (``k`` asked,
    proposed, kept; ``DrafterRecord.by_position``). Given each request's prompt and position
    too, a step the trace settles for the k asked (``replay_step``) is replayed as it went
    live, so a request takes the steps its live run took; any other is drawn as above."""

    joint: dict[int, np.ndarray]
    min_steps: int = 30
    by_prompt: dict[int, "RecordedAcceptance"] = field(default_factory=dict)
    trace: dict[int, dict[int, tuple[int, int, int]]] = field(default_factory=dict)
    replayed: int = 0  # request-steps replayed from the trace, and drawn, so far
    drawn: int = 0
    full: bool = field(init=False)  # every recorded step proposed all it asked for (a draft model)
    _ask: np.ndarray = field(init=False)  # conditional acceptance per position of asking
    _there: np.ndarray = field(init=False)  # chance a candidate is proposed at p, given p - 1 were
    _keep: np.ndarray = field(init=False)  # acceptance of a proposed candidate at p, given p - 1 kept

    def __post_init__(self) -> None:
        joint = {}
        for k, h in self.joint.items():
            h = np.asarray(h, dtype=np.int64)
            if int(k) < 1 or h.shape != (int(k) + 1, int(k) + 1) or np.any(h < 0) or np.any(np.triu(h, 1)):
                raise ValueError(f"joint[{k}]: needs a [k + 1, k + 1] count matrix H[proposed, kept] with kept <= "
                                 f"proposed, got {h.tolist()}")
            if h.sum() > 0:
                joint[int(k)] = h
        self.joint = joint
        self.full = bool(joint) and all(h[:k].sum() == 0 for k, h in joint.items())
        tried, acc = pooled_positions({k: h.sum(axis=0) for k, h in joint.items()})
        self._ask = _ratio(acc, tried)
        asked, there, tried_p, kept = pooled_proposals(joint)
        self._there, self._keep = _ratio(there, asked), _ratio(kept, tried_p)

    @classmethod
    def from_record(cls, rec: DrafterRecord, min_steps: int = 30, per_prompt: bool = True,
                    per_position: bool = True) -> "RecordedAcceptance":
        """``per_prompt``: keep the record's per-prompt counts (false: the class's alone);
        ``per_position`` (with it): its per-position trace too."""
        per = {int(p): cls({k: np.array(v) for k, v in j.items()}, min_steps)
               for p, j in ((rec.by_prompt or {}).items() if per_prompt else ())}
        trace = {int(p): {int(t): (int(x[0]), int(x[1]), int(x[2])) for t, x in tr.items()}
                 for p, tr in ((rec.by_position or {}).items() if per_prompt and per_position else ())}
        return cls({k: np.array(v) for k, v in rec.joint.items()}, min_steps,
                   {p: m for p, m in per.items() if m.steps >= min_steps}, trace)

    @property
    def steps(self) -> int:
        return int(sum(h.sum() for h in self.joint.values()))

    def _enough(self, k: int) -> np.ndarray | None:
        h = self.joint.get(k)
        return h if h is not None and h.sum() >= self.min_steps else None

    def position_probs(self, K: int) -> np.ndarray:
        """Conditional acceptance per position of asking for K candidates."""
        return _extend(self._ask, K)

    def proposal_probs(self, K: int) -> tuple[np.ndarray, np.ndarray]:
        """(chance a candidate is there, acceptance of a proposed one) per position."""
        return _extend(self._there, K), _extend(self._keep, K)

    def _covers(self, k: int) -> bool:
        return self._enough(k) is not None or (self.steps >= self.min_steps and max(self.joint, default=0) >= k)

    def _by_prompt(self, k: int, prompts) -> list[tuple[np.ndarray | None, "RecordedAcceptance"]]:
        """(rows or None for all, the model that replays them): the rows of each prompt whose
        recording covers ``k`` from it, the rest from the class's."""
        if prompts is None or not self.by_prompt:
            return [(None, self)]
        prompts = np.asarray(prompts)
        own = {int(p): self.by_prompt[int(p)] for p in np.unique(prompts)
               if int(p) in self.by_prompt and self.by_prompt[int(p)]._covers(k)}
        rest = ~np.isin(prompts, list(own)) if own else np.ones(prompts.size, dtype=bool)
        out = [(np.flatnonzero(prompts == p), m) for p, m in own.items()]
        return out + ([(np.flatnonzero(rest), self)] if rest.any() else [])

    def _draw(self, k: int, n: int, prompts, draw) -> tuple[np.ndarray, ...]:
        """``draw(model, size)``'s arrays for ``n`` requests, each row from its prompt's model
        (``_by_prompt``)."""
        parts = self._by_prompt(k, prompts)
        if parts[0][0] is None:
            return draw(self, n)
        got = [(rows, draw(m, rows.size)) for rows, m in parts]
        out = tuple(np.zeros(n, dtype=np.int64) for _ in got[0][1])
        for rows, arrays in got:
            for o, a in zip(out, arrays):
                o[rows] = a
        return out

    def sample(self, k: int, n: int, rng: np.random.Generator, prompts=None) -> np.ndarray:
        """[n] accepted of ``k`` asked; ``prompts``: [n] each request's prompt (see the class)."""
        return self._draw(k, n, prompts, lambda m, size: (m._sample(k, size, rng),))[0]

    def sample_proposed(self, k: int, n: int, rng: np.random.Generator, prompts=None, positions=None,
                        limits=None) -> tuple[np.ndarray, np.ndarray]:
        """[n] candidates proposed and [n] of them accepted, asking for ``k``; ``prompts``: [n]
        each request's prompt, ``positions``: [n] its output tokens so far, ``limits``: [n] the
        most candidates it may verify (its tokens left less one, as the engine clamps k); see
        the class."""
        proposed, accepted = self._draw(k, n, prompts, lambda m, size: m._sample_proposed(k, size, rng))
        if not self.trace or prompts is None or positions is None:
            self.drawn += n
            return proposed, accepted
        row_model = None
        for i, (p, t) in enumerate(zip(np.asarray(prompts).tolist(), np.asarray(positions).tolist())):
            seen = self.trace.get(p, {}).get(t)
            asked = k if limits is None else min(k, int(limits[i]))
            got = None if seen is None else replay_step(asked, *seen, full=self.full)
            if got is None:
                self.drawn += 1
                continue
            lo, hi, kept = got
            if lo < hi:  # the live step proposed all it asked for: how many more is drawn given that
                if row_model is None:
                    row_model = self._row_models(k, prompts, n)
                lo = row_model[i]._proposed_within(asked, lo, hi, rng)
            proposed[i], accepted[i] = lo, kept  # kept as it went
            self.replayed += 1
        return proposed, accepted

    def _row_models(self, k: int, prompts, n: int) -> list["RecordedAcceptance"]:
        """The model that replays each of ``n`` rows (``_by_prompt``)."""
        out: list = [self] * n
        for rows, m in self._by_prompt(k, prompts):
            for r in (range(n) if rows is None else rows.tolist()):
                out[r] = m
        return out

    def _proposed_within(self, k: int, lo: int, hi: int, rng: np.random.Generator) -> int:
        """Candidates proposed asking for ``k``, given that there were ``lo`` to ``hi``: drawn
        from the recording's proposals at ``k`` that fall there, or where ``k`` has too few
        steps, candidate by candidate past ``lo`` at the chance one is there given the one
        before was. Clamping an unconditional draw into [lo, hi] instead piles every shorter
        proposal onto ``lo``: a drafter that ran to the end of a short ask mostly runs on."""
        h = self._enough(k)
        if h is not None:
            pm = h.sum(axis=1)[lo: hi + 1].astype(float)
            if pm.sum() > 0:
                return lo + int(rng.choice(pm.size, p=pm / pm.sum()))
        there, _ = self.proposal_probs(k)
        m = lo
        while m < hi and rng.random() < there[m]:
            m += 1
        return m

    def _sample(self, k: int, n: int, rng: np.random.Generator) -> np.ndarray:
        h = self._enough(k)
        if h is not None:
            hist = h.sum(axis=0)
            return rng.choice(k + 1, size=n, p=hist / hist.sum())
        ok = rng.random((n, k)) < self.position_probs(k)
        return np.cumprod(ok, axis=1).sum(axis=1)

    def _sample_proposed(self, k: int, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        h = self._enough(k)
        if h is not None:
            flat = rng.choice(h.size, size=n, p=(h / h.sum()).ravel())
            return flat // (k + 1), flat % (k + 1)
        there, keep = self.proposal_probs(k)
        proposed = np.cumprod(rng.random((n, k)) < there, axis=1).sum(axis=1)
        accepted = np.cumprod(rng.random((n, k)) < keep, axis=1).sum(axis=1)
        return proposed, np.minimum(accepted, proposed)


def replay_step(k: int, k_seen: int, m: int, j: int, full: bool = False) -> tuple[int, int, int] | None:
    """What asking for ``k`` gives where a live step asked for ``k_seen``, had ``m`` proposed
    and kept ``j``: (fewest proposed, most proposed, kept); None where that step does not
    settle what is kept (all ``k_seen`` kept and ``k`` asks for more). A drafter's first
    candidates do not depend on how many are asked for (a draft model drafts them one by one,
    n-gram lookup copies one continuation), and under greedy decoding neither does which of
    them are kept. Past ``k_seen`` the candidates proposed are not seen, unless the drafter
    ran out (m < k_seen) or always proposes what it is asked for (``full``: a draft model)."""
    if m < k_seen:  # the drafter had no more to propose
        m2 = min(k, m)
        return m2, m2, min(j, m2)
    if j < m:  # candidate j + 1 was rejected: any k keeps at most j
        return (k, k, min(j, k)) if k <= k_seen or full else (k_seen, k, j)
    return (k, k, k) if k <= k_seen else None


def confidence_calibration(rec: DrafterRecord) -> np.ndarray | None:
    """Accepted share of verified tokens per confidence bin (nan where none was verified): the
    ``g`` a ``ConfidenceAcceptance`` takes as ``calibration``; None without confidences."""
    c = rec.confidence
    if c is None:
        return None
    a, r = np.asarray(c.accepted, dtype=float), np.asarray(c.rejected, dtype=float)
    return np.divide(a, a + r, out=np.full(a.size, np.nan), where=(a + r) > 0)


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
    # another class's prompt indices name other prompts
    model = RecordedAcceptance.from_record(rec, spec.min_steps, spec.per_prompt and cls == request_class,
                                           spec.per_position)
    if model.steps == 0:
        raise ValueError(f"{where}: {path} holds no request-steps of class {cls!r} with drafter {d!r}")
    return model
