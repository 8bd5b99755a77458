"""TargetEngine: one continuous-batching engine per replica (in an engine process of its own,
``ProcessEngineLoop``, or on a thread of the replica, ``EngineLoop``); also the app's ingress
(the gRPC methods of the ``Ingress`` mixin), so Serve's proxy hands each call straight to
the replica whose engine runs it.

Requests from every caller share the replica's batches. A report task sends the
engine's step stats to the Controller every ``controller.report_interval_s`` and installs
the ``PolicySnapshot`` it answers with; a missing or failing Controller leaves the last
snapshot in place (requests never wait on it).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import sys
import time

from ray import serve

from adaptspec.control.types import StepOutcome
from adaptspec.serve.config import ServiceConfig
from adaptspec.serve.ingress import Ingress
from adaptspec.serve.loop import slo_admission
from adaptspec.serve.types import EngineRequest, ReplicaReport

log = logging.getLogger(__name__)

STEP_LOG_MAX = 200_000  # steps a replica's step log keeps (about 100 MB at most)


@serve.deployment(name="TargetEngine", max_ongoing_requests=1024, health_check_period_s=5)
class TargetEngine(Ingress):
    async def __init__(self, config: dict, controller=None, drafter=None):
        from adaptspec.serve.metrics import ServiceMetrics

        cfg = self.config = ServiceConfig.model_validate(config)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # local testing mode
            self.replica_id = "local"
        if cfg.engine_isolation == "process":
            from adaptspec.serve.engine_proc import ProcessEngineLoop

            self.loop = await ProcessEngineLoop.start(cfg, replica_id=self.replica_id)
        else:
            self.loop = await self._thread_loop(cfg, drafter)
        self.loop.admission = slo_admission(cfg)
        try:
            self.controller = controller
            self.metrics = ServiceMetrics(cfg)
            self._faults_reported = 0
            self._step_log: collections.deque | None = None  # off until a client asks (start_step_log)
            self._report_task = asyncio.get_running_loop().create_task(self._report_forever())
        except BaseException:
            self.loop.stop()  # no engine (process) left behind by a replica that failed to start
            raise

    async def _thread_loop(self, cfg: ServiceConfig, drafter):
        """The engine on a thread of this replica (``engine.isolation: thread``; the disaggregated
        placement, whose draft proposer calls Drafter replicas through this replica's handles)."""
        from adaptspec.serve.engine_proc import build_engine, warn_slow_bf16
        from adaptspec.serve.faults import guard_proposers
        from adaptspec.serve.loop import EngineLoop

        # the engine thread releases the GIL in every torch op and must get it back quickly:
        # a short switch interval keeps Serve's threads from holding it for 5 ms at a time
        sys.setswitchinterval(0.0005)
        engine = await asyncio.to_thread(build_engine, cfg)
        warn_slow_bf16(cfg)  # after the load: it built or loaded the kernel off the event loop
        if drafter is not None:  # disaggregated placement: the draft model lives in Drafter replicas
            from adaptspec.serve.drafter import RemoteDraftProposer

            engine.add_proposer("draft", RemoteDraftProposer(drafter, self.replica_id, asyncio.get_running_loop()))
        guards = guard_proposers(engine, inject=cfg.faults)
        return EngineLoop(engine, max_queued=cfg.engine.max_queued, replica_id=self.replica_id,
                          faults_fn=lambda: sum(g.faults for g in guards), stall_timeout_s=cfg.engine.stall_timeout_s)

    def engine_stream(self, req: EngineRequest):
        """``EngineChunk``s for one request (rules in ``adaptspec.serve.loop``)."""
        return self.loop.generate(req)

    def serving(self) -> bool:
        return self.loop.alive

    async def check_health(self) -> None:
        if not self.loop.alive:
            raise RuntimeError("the replica's engine died (see its log)")

    # ---- a step log for `adaptspec fidelity --grpc` (not on the gRPC API: a Serve handle call) ----
    async def start_step_log(self, max_steps: int = STEP_LOG_MAX) -> None:
        """Keep every engine step's ``sim.step_shapes.record`` from now on (the newest
        ``max_steps``), for ``take_step_log``: the fidelity check prices a live run's own steps."""
        self._step_log = collections.deque(maxlen=max_steps)

    async def take_step_log(self) -> list:
        """The steps logged since the last call, oldest first, once every step that ended before
        this call has passed the report task (which hands them on)."""
        if self._step_log is None:
            raise RuntimeError("no step log: call start_step_log first")
        await asyncio.sleep(self.config.controller.report_interval_s + 0.25)
        out = list(self._step_log)
        self._step_log.clear()
        return out

    async def _report_forever(self) -> None:
        from adaptspec.serve.loop import class_deltas
        from adaptspec.sim.step_shapes import record

        interval = self.config.controller.report_interval_s
        last = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            steps = self.loop.take_step_stats()
            finished = self.loop.take_finished()
            now = time.monotonic()
            if self._step_log is not None:
                self._step_log.extend(record(st) for st in steps)
            try:
                self._record_metrics(steps, finished)
                if self.controller is None:
                    continue
                deltas = class_deltas(steps)
                for cls, _, _ in finished:
                    deltas.setdefault(cls, _delta(cls)).requests += 1
                rep = ReplicaReport(self.loop.state(), [StepOutcome.from_step_stats(s) for s in steps],
                                    list(deltas.values()), now - last)
                last = now
                self.loop.snapshot = await self.controller.report.remote(rep)
            except asyncio.CancelledError:
                raise
            except Exception:  # the controller restarting, say: keep serving with the last snapshot
                log.warning("report to the controller failed", exc_info=True)

    def _record_metrics(self, steps, finished) -> None:
        self.metrics.observe_steps(steps)
        self.metrics.observe_state(self.loop.state(), self.loop.snapshot)
        for cls, reason, tokens in finished:
            self.metrics.observe_finished(cls, reason, tokens)
        faults = self.loop.state().drafter_faults
        if faults > self._faults_reported:
            self.metrics.drafter_faults.inc(faults - self._faults_reported)
            self._faults_reported = faults

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()


def _delta(cls: str):
    from adaptspec.serve.types import ClassDelta

    return ClassDelta(cls)
