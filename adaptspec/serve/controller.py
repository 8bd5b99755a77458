"""The Controller: a singleton that aggregates live stats from every target replica, runs
the policy and answers each report with a fresh ``PolicySnapshot``.

``ControlCore`` is Ray-free (and engine-free): the deployment is a thin async shell, so
calls are serialised on its event loop.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import pickle
import time
from pathlib import Path
from dataclasses import dataclass, field

import numpy as np
from ray import serve

from adaptspec.control import NO_SPEC, Arm, ClassTarget, Load, StepOutcome
from adaptspec.control.base import draft_positions
from adaptspec.serve.config import ServiceConfig
from adaptspec.serve.policies import AVAILABLE, load_cost_prior, make_policy
from adaptspec.serve.types import ClassDelta, PolicySnapshot, ReplicaReport, ReplicaState

GOODPUT_WINDOW_S = 10.0
CHECKPOINT_FORMAT = 2  # bump when the pickled state's shape changes: older checkpoints are then ignored
CHECKPOINT_NAMESPACE = "adaptspec"
log = logging.getLogger(__name__)


@dataclass(slots=True)
class ClassView:
    request_class: str
    requests: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    steps: int = 0
    current_arm: str = "none"
    goodput_tokens_per_s: float = 0.0
    pinned: bool = False

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0


@dataclass(slots=True)
class CostCheck:
    """A model-based policy's predicted step time (the decode part: what it ranks arms by)
    against the measured one, summed per row: verify tokens in buckets of ``bucket``,
    steps with drafted rows (more verify tokens than decoding requests) apart from plain ones.
    Each step is predicted before the policy learns from it. Why apart: a cost model that prices
    plain steps right and drafted rows low steers the policy into speculation that does not pay,
    and a mean over both hides it. Sums, not samples: the controller keeps one for as long as it runs."""

    rows: dict[tuple[int, bool], list[float]] = field(default_factory=dict)  # -> [steps, predicted s, measured s]
    bucket: int = 8  # verify tokens a row spans

    def add(self, policy, outcome: StepOutcome) -> None:
        cost = getattr(policy, "cost", None)
        if cost is None or not outcome.groups:
            return
        n_dec = sum(g.num_requests for g in outcome.groups)
        batch, ngram = draft_positions(outcome, policy.config.max_k)
        pred = cost.predict(np.array([float(outcome.verify_tokens)]), outcome.context_tokens, batch, 0.0,
                            np.zeros(1), np.array([float(ngram)]), outcome.context_tokens / max(n_dec, 1))
        drafted = outcome.verify_tokens - outcome.num_prefill > n_dec
        row = self.rows.setdefault((outcome.verify_tokens // self.bucket * self.bucket, drafted), [0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += float(pred[0])
        row[2] += outcome.verify_s + outcome.draft_s + outcome.other_s

    def table(self) -> list[dict]:
        """Per row: verify tokens (\"8-15\"), drafted, steps, mean predicted and measured ms."""
        return [{"verify_tokens": f"{b}-{b + self.bucket - 1}", "drafted": d, "steps": int(n),
                 "predicted_ms": 1e3 * p / n, "measured_ms": 1e3 * m / n}
                for (b, d), (n, p, m) in sorted(self.rows.items()) if n > 0]


@dataclass(slots=True)
class StatsView:
    classes: list[ClassView]
    replicas: list[ReplicaState]
    policy: str
    version: int
    uptime_s: float
    # CPU seconds since start: in the policy's own calls (observing reports, choosing arms), and
    # the controller's whole process (None where it is not the controller's alone: in-process)
    policy_cpu_s: float = 0.0
    process_cpu_s: float | None = None
    cost_check: CostCheck | None = None  # the policy in force's (None: it has no cost model)


@dataclass(slots=True)
class PolicyView:
    policy: str
    classes: list[tuple[str, str, bool]]  # (class, arm, pinned)
    version: int
    drafters: tuple[str, ...]
    max_k: int
    available: tuple[str, ...] = AVAILABLE


@dataclass(slots=True)
class PolicyUpdate:
    policy: str = ""  # empty: keep
    pins: list[tuple[str, Arm]] = field(default_factory=list)
    unpins: list[str] = field(default_factory=list)
    reset: bool = False  # start the policy afresh instead of resuming what it learned


class ControlCore:
    def __init__(self, config: ServiceConfig, *, clock=time.monotonic, own_process: bool = False):
        self.config = config
        self.clock = clock
        self.started = clock()
        # own_process: the controller has the process to itself (the Serve deployment), so the
        # process's CPU time is the controller's and stats report it
        self.own_process = own_process
        self.policy_cpu_s = 0.0
        self.cost_checks: dict[str, CostCheck] = {}  # per policy name: its cost model against the steps
        self.drafters = config.drafters
        self.max_k = config.controller.max_k
        self.targets = tuple(ClassTarget(c.name, c.tpot_s, c.ttft_s) for c in config.classes
                             if c.tpot_s is not None or c.ttft_s is not None)
        m = config.models
        self.prior_cost = load_cost_prior(config.controller.cost_profile, target=m.target, dtype=m.dtype,
                                          device=m.device, draft=m.draft)
        self.policy_name = config.controller.policy
        self.policy = self._make(self.policy_name, "controller.policy")
        # every policy used in this process, by name: switching back resumes what it learned
        # (an operator comparing policies should not throw away hours of acceptance data)
        self._policies = {self.policy_name: self.policy}
        self.pins: dict[str, Arm] = {c.name: Arm(c.pin.drafter, c.pin.k) for c in config.classes if c.pin}
        self.classes: dict[str, ClassView] = {c: ClassView(c) for c in config.class_names}
        self.replicas: dict[str, ReplicaState] = {}
        self.current: dict[str, Arm] = {}
        self.version = 0
        self._emitted: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._refresh(Load())

    def _make(self, name: str, field_name: str):
        return make_policy(name, drafters=self.drafters, max_k=self.max_k, targets=self.targets,
                           seed=self.config.controller.seed, prior_cost=self.prior_cost,
                           fade_half_life_s=self.config.controller.fade_half_life_s,
                           fade_min_steps=self.config.controller.fade_min_steps,
                           thresholds=tuple(self.config.controller.confidence_thresholds), field=field_name,
                           classes=tuple(self.config.class_names))

    # ---- replicas ------------------------------------------------------------------------
    def report(self, rep: ReplicaReport) -> PolicySnapshot:
        now = self.clock()
        # The policy's CPU time (this thread's, so time spent waiting for the GIL or the core is
        # not counted): what adapting costs the node beside the engine, which a static policy
        # hardly pays; on a CPU replica it is taken from the cores the engine runs on.
        if getattr(self.policy, "cost", None) is not None:
            check = self.cost_checks.setdefault(self.policy_name, CostCheck())
            for outcome in rep.outcomes:  # what the policy predicted for each step before it learns from it
                check.add(self.policy, outcome)
        cpu0 = time.thread_time()
        for outcome in rep.outcomes:
            self.policy.observe(outcome)
        self.policy_cpu_s += time.thread_time() - cpu0
        for d in rep.classes:
            self._add(d, now)
        st = rep.state
        if rep.outcomes and rep.interval_s > 0:
            st.step_time_s = sum(o.wall_s for o in rep.outcomes) / len(rep.outcomes)
            st.tokens_per_s = sum(d.emitted for d in rep.classes) / rep.interval_s
        elif st.replica_id in self.replicas:
            st.step_time_s = self.replicas[st.replica_id].step_time_s if st.batch_size else 0.0
        self.replicas[st.replica_id] = st
        load = Load(batch_size=max(st.batch_size, 1), queued=st.num_waiting, verify_tokens=st.verify_tokens,
                    context_tokens=st.context_tokens)
        return self._refresh(load)

    def _add(self, d: ClassDelta, now: float) -> None:
        view = self.classes.get(d.request_class)
        if view is None:
            view = self.classes[d.request_class] = ClassView(d.request_class)
        view.requests += d.requests
        view.drafted += d.drafted
        view.accepted += d.accepted
        view.emitted += d.emitted
        view.steps += d.steps
        if d.emitted:
            self._emitted[d.request_class].append((now, d.emitted))

    def _refresh(self, load: Load) -> PolicySnapshot:
        free = [c for c in self.classes if c not in self.pins]
        cpu0 = time.thread_time()
        self.current.update(zip(free, self.policy.choose_many(free, load) if free else []))
        self.policy_cpu_s += time.thread_time() - cpu0
        self.current.update((c, arm) for c, arm in self.pins.items() if c in self.classes)
        self.version += 1
        return self.snapshot()

    def snapshot(self) -> PolicySnapshot:
        return PolicySnapshot(self.version, dict(self.current), self.current.get("default", NO_SPEC))

    # ---- operators ---------------------------------------------------------------------
    def stats(self) -> StatsView:
        now = self.clock()
        views = []
        for c, v in self.classes.items():
            q = self._emitted[c]
            while q and q[0][0] < now - GOODPUT_WINDOW_S:
                q.popleft()
            span = min(GOODPUT_WINDOW_S, max(now - self.started, 1e-9))
            v.goodput_tokens_per_s = sum(n for _, n in q) / span
            v.current_arm = str(self.current.get(c, NO_SPEC))
            v.pinned = c in self.pins
            views.append(v)
        return StatsView(views, list(self.replicas.values()), self.policy_name, self.version, now - self.started,
                         self.policy_cpu_s, time.process_time() if self.own_process else None,
                         self.cost_checks.get(self.policy_name))

    def policy_view(self) -> PolicyView:
        return PolicyView(self.policy_name, [(c, str(self.current.get(c, NO_SPEC)), c in self.pins)
                                             for c in self.classes], self.version, self.drafters, self.max_k)

    def update(self, upd: PolicyUpdate) -> PolicyView:
        """Switch policy and pin/unpin arms; ValueError names the field. All or nothing."""
        name = upd.policy or (self.policy_name if upd.reset else "")
        new_policy = None
        if name:
            new_policy = None if upd.reset else self._policies.get(name)
            if new_policy is None:
                new_policy = self._make(name, "policy")
        pins = dict(self.pins)
        for i, (c, arm) in enumerate(upd.pins):
            if not c:
                raise ValueError(f"pin[{i}].request_class: empty")
            if c not in self.classes and self.config.strict_classes:
                raise ValueError(f"pin[{i}].request_class: unknown class {c!r}")
            if arm.k and arm.drafter not in self.drafters:
                raise ValueError(f"pin[{i}].arm.drafter: {arm.drafter!r} is not available (drafters: "
                                 f"{', '.join(self.drafters)})")
            if arm.k > self.max_k:
                raise ValueError(f"pin[{i}].arm.k: {arm.k} exceeds max_k={self.max_k}")
            pins[c] = arm
        for i, c in enumerate(upd.unpins):
            if c not in pins:
                raise ValueError(f"unpin[{i}]: class {c!r} is not pinned")
            del pins[c]
        if new_policy is not None:
            self.policy, self.policy_name = new_policy, name
            self._policies[name] = new_policy
        self.pins = pins
        for c in pins:
            self.classes.setdefault(c, ClassView(c))
        self._refresh(Load())
        return self.policy_view()

    # ---- checkpoints ---------------------------------------------------------------------
    def _fingerprint(self) -> tuple:
        """What a checkpoint's policies were built for: restoring them elsewhere would be wrong."""
        from adaptspec import __version__

        # the code's version too: policies pickled by other code may not fit this code's classes
        return (CHECKPOINT_FORMAT, __version__, self.drafters, self.max_k, self.targets)

    def state_bytes(self) -> bytes:
        """What the policies learned, the operator's choices and the per-class counters."""
        return pickle.dumps({"fingerprint": self._fingerprint(), "policy_name": self.policy_name,
                             "policies": self._policies, "pins": self.pins, "classes": self.classes,
                             "version": self.version}, protocol=pickle.HIGHEST_PROTOCOL)

    def restore(self, data: bytes) -> bool:
        """Resume from ``state_bytes``; False (and nothing changed) when the checkpoint was made
        for other drafters, max_k or latency targets."""
        state = pickle.loads(data)  # noqa: S301 - written by this controller to a store only it writes
        if state.get("fingerprint") != self._fingerprint():
            return False
        policy = state["policies"][state["policy_name"]]
        policy.choose_many(list(state["classes"]) or ["default"], Load())  # raises if it does not fit this code
        self._policies = state["policies"]
        self.policy_name = state["policy_name"]
        self.policy = policy
        self.pins = state["pins"]
        self.classes.update(state["classes"])
        self.version = state["version"]
        self._refresh(Load())
        return True


class CheckpointStore:
    """Where the controller's state lives between restarts: Ray's GCS key-value store
    (``ray``: outlives the controller's actor; with GCS fault tolerance, the head too) or a
    file (a volume's path: outlives the Ray cluster). Writes are whole and atomic."""

    def __init__(self, where: str, app_name: str):
        self.where, self.key = where, f"adaptspec/{app_name}/controller-state".encode()

    def load(self) -> bytes | None:
        if self.where == "ray":
            from ray.experimental import internal_kv

            return internal_kv._internal_kv_get(self.key, namespace=CHECKPOINT_NAMESPACE)
        path = Path(self.where).expanduser()
        return path.read_bytes() if path.is_file() else None

    def save(self, data: bytes) -> None:
        if self.where == "ray":
            from ray.experimental import internal_kv

            internal_kv._internal_kv_put(self.key, data, overwrite=True, namespace=CHECKPOINT_NAMESPACE)
            return
        path = Path(self.where).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def lower_priority(niceness: int) -> int | None:
    """Put every thread of this process at least ``niceness`` below normal CPU priority;
    returns the niceness now in force (None where it cannot be read or set).

    Why: on a CPU replica the engine's matrix products run on every core in lock step
    (OpenMP), so any other process that takes a core from one of its threads for a
    scheduler slice stalls the whole step; the controller's bursts of work (a report's steps,
    a plan, a checkpoint) did exactly that next to the engine. At a lower priority the
    scheduler runs them in the engine's idle moments instead. Linux applies niceness per
    thread, so it is set for each thread there is (threads started later inherit it)."""
    if niceness <= 0:
        return None
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the process's priority
        tids = [0]
    held = []  # the niceness each thread holds afterwards
    for tid in tids:
        try:
            cur = os.getpriority(os.PRIO_PROCESS, tid)
            if cur < niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
            held.append(max(cur, niceness))
        except (OSError, AttributeError) as exc:  # a thread that ended meanwhile; no setpriority here
            log.debug("controller: cannot lower the priority of thread %s: %s", tid, exc)
    now = min(held, default=None)  # the least lowered thread
    if now is None:
        log.warning("controller.niceness: could not lower this process's CPU priority; its work may stall the "
                    "engine on a shared CPU node")
    return now


@serve.deployment(name="Controller", num_replicas=1, ray_actor_options={"num_cpus": 0})
class Controller:
    """One controller for every target replica (each sends its reports here and runs on the
    snapshots it answers with). With ``controller.checkpoint`` set, it resumes the last
    checkpoint at start and writes one every ``checkpoint_interval_s`` while its state changes
    and after every policy update."""

    async def __init__(self, config: dict):
        cfg = ServiceConfig.model_validate(config)
        lower_priority(cfg.controller.niceness)
        self.core = ControlCore(cfg, own_process=True)
        self.store = CheckpointStore(cfg.controller.checkpoint, cfg.app_name) if cfg.controller.checkpoint else None
        self._saved_version = -1
        self._task = None
        if self.store is not None:
            self._restore()
            self._task = asyncio.get_running_loop().create_task(self._checkpoint_forever(
                cfg.controller.checkpoint_interval_s))

    def _restore(self) -> None:
        try:
            data = self.store.load()
            if data is None:
                return
            if self.core.restore(data):
                self._saved_version = self.core.version
                log.info("controller state restored from %s (policy %s, version %d)", self.store.where,
                         self.core.policy_name, self.core.version)
            else:
                log.warning("controller checkpoint in %s was made for other drafters, max_k or targets: "
                            "starting afresh", self.store.where)
        except Exception:  # a damaged checkpoint must not keep the service down: start afresh
            log.exception("controller checkpoint in %s unreadable: starting afresh", self.store.where)

    def checkpoint(self) -> bool:
        """Write the state if it changed since the last write; False if the write failed."""
        if self.store is None or self.core.version == self._saved_version:
            return True
        version = self.core.version
        try:
            self.store.save(self.core.state_bytes())
        except Exception:
            log.warning("controller checkpoint to %s failed", self.store.where, exc_info=True)
            return False
        self._saved_version = version
        return True

    async def _checkpoint_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.checkpoint()

    async def report(self, rep: ReplicaReport) -> PolicySnapshot:
        return self.core.report(rep)

    async def snapshot(self) -> PolicySnapshot:
        return self.core.snapshot()

    async def stats(self) -> StatsView:
        return self.core.stats()

    async def policy(self) -> PolicyView:
        return self.core.policy_view()

    async def update_policy(self, upd: PolicyUpdate) -> PolicyView | str:
        """The new policy view, or the ValueError message (the caller maps it to INVALID_ARGUMENT)."""
        try:
            view = self.core.update(upd)
        except ValueError as exc:
            return str(exc)
        self.checkpoint()  # an operator's change survives a restart that follows it at once
        return view

    async def save_checkpoint(self) -> bool:
        """Write a checkpoint now (tests, and an operator before a planned restart)."""
        return self.checkpoint()
