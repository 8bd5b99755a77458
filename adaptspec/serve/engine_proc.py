"""The replica's engine in an OS process of its own (``engine.isolation: process``, the default).

Why: a Python process runs one thread at a time (the GIL). With the engine on a thread of
the Serve replica, every step gives the GIL up and takes it back a few hundred times (each
torch op and C call releases it), and whenever Serve's side of the replica holds it then
(request handling, metrics, the controller report) the step waits: on the 2-core CPU box
that cost a few ms per request, about what those threads ran (docs/results/service-runs.md,
"engine process vs engine thread").
In a process of its own the engine's thread is alone with its GIL; the replica keeps the
gRPC methods, the callers' streams and the report, and talks to the engine over a
socketpair. The same split as vLLM's engine-core process, for the same reason.

Protocol (pickled messages, ``multiprocessing.connection``):

- replica -> engine: the ``ServiceConfig`` as a dict (first), then ``("add", EngineRequest)``,
  ``("abort", request_id)``, ``("snapshot", PolicySnapshot)``, ``("stop",)``;
- engine -> replica: ``("ready", info)`` or ``("error", traceback)`` (first), then
  ``("admitted", request_id, error_or_None)``, ``("step", chunks, step_stats, finished,
  state)`` after every step and ``("state", state)`` after commands.

The engine process exits when its socket closes, so it never outlives its replica (a
replica killed by Ray closes it too). If the engine process dies, every caller gets
UNAVAILABLE, later requests are refused with it, and the replica's health check fails, so
Serve replaces the replica: nothing admitted is lost.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from adaptspec.serve.config import ServiceConfig
from adaptspec.serve.loop import EngineCore, _Callers, _drain
from adaptspec.serve.types import PolicySnapshot, ReplicaState

log = logging.getLogger(__name__)


def build_engine(cfg: ServiceConfig, *, target: str | None = None, torch_threads: int | None = None):
    """The replica's engine as the config says (torch threads, models, KV slots); either isolation.
    ``target`` / ``torch_threads`` override the config (the load test's in-process baseline;
    another target means no draft)."""
    import torch

    from adaptspec import Engine

    torch.set_num_threads(torch_threads or cfg.engine.torch_threads or max(1, int(cfg.target.num_cpus or 1)))
    draft = cfg.models.draft if cfg.placement == "colocated" and not target else None
    engine = Engine.from_pretrained(target or cfg.models.target, draft=draft, dtype=cfg.models.dtype,
                                    device=cfg.models.device, max_num_seqs=cfg.engine.max_num_seqs,
                                    max_model_len=cfg.engine.max_model_len,
                                    max_num_batched_tokens=cfg.engine.max_num_batched_tokens,
                                    block_size=cfg.engine.block_size,
                                    enable_prefix_caching=cfg.engine.enable_prefix_caching,
                                    kv_cache_memory=cfg.engine.kv_cache_memory,
                                    cuda_graphs=cfg.engine.cuda_graphs,
                                    cuda_graph_max_tokens=cfg.engine.cuda_graph_max_tokens)
    engine.pacer = prefill_pacer(cfg)
    return engine


def prefill_pacer(cfg: ServiceConfig):
    """The replica's TPOT-paced prefill from ``ServiceConfig.pacing`` (None: off, or no class
    has a TPOT target)."""
    from adaptspec.control.pacing import PrefillPacer

    tpot = {c.name: c.tpot_s for c in cfg.classes if c.tpot_s is not None}
    if not cfg.pacing.enabled or not tpot:
        return None
    ttft = {c.name: c.ttft_s for c in cfg.classes if c.ttft_s is not None}
    return PrefillPacer(tpot, ttft, margin=cfg.pacing.margin, slack=cfg.pacing.slack)


def warn_slow_bf16(cfg: ServiceConfig) -> None:
    """bf16 on the CPU is fast only on the C kernel (bf16 weights, fp32 compute around the products)."""
    if cfg.models.resolved_dtype() != "bfloat16" or not cfg.models.device.startswith("cpu"):
        return
    from adaptspec.models import cpu_gemm

    if not cpu_gemm.enabled():
        log.warning("models.dtype is bfloat16 but the CPU kernel is off (%s): bf16 runs on torch, slower "
                    "than float32 on CPUs without native bf16 arithmetic (the project's test box: "
                    "README.md); set models.dtype: float32 or install a C compiler", cpu_gemm.status())


# ---- the replica's side -------------------------------------------------------------------------
class ProcessEngineLoop(_Callers):
    """``EngineLoop``'s interface over an engine process (start it with ``await ProcessEngineLoop.start``)."""

    def __init__(self, proc: subprocess.Popen, conn: Connection, info: dict, *, max_queued: int, replica_id: str):
        super().__init__(drafters=tuple(info["drafters"]), max_in_flight=info["max_num_seqs"] + max_queued,
                         replica_id=replica_id, detok=info["tokenizer"])
        self.proc, self._conn = proc, conn
        self._send_lock = threading.Lock()
        self._snapshot = PolicySnapshot()
        self._state = ReplicaState(replica_id, free_slots=info["max_num_seqs"])
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="adaptspec-engine-reader", daemon=True)
        self._reader.start()

    @classmethod
    async def start(cls, cfg: ServiceConfig, *, replica_id: str = "local", startup_timeout_s: float = 1800.0):
        """Spawn the engine process and wait (off the event loop) until its models are loaded."""
        mine, theirs = socket.socketpair()
        # the child inherits only its end of the pair
        proc = subprocess.Popen([sys.executable, "-m", "adaptspec.serve.engine_proc", str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        conn = Connection(mine.detach())
        try:
            conn.send(cfg.model_dump(mode="json"))
            info = await asyncio.to_thread(_wait_ready, conn, proc, startup_timeout_s)
        except BaseException:
            conn.close()
            _reap(proc)
            raise
        return cls(proc, conn, info, max_queued=cfg.engine.max_queued, replica_id=replica_id)

    @property
    def snapshot(self) -> PolicySnapshot:
        return self._snapshot

    @snapshot.setter
    def snapshot(self, snap: PolicySnapshot) -> None:
        self._snapshot = snap
        self._post(("snapshot", snap))

    @property
    def alive(self) -> bool:
        return self._dead is None and self.proc.poll() is None

    def state(self) -> ReplicaState:
        return dataclasses.replace(self._state, replica_id=self.replica_id, in_flight=len(self._streams))

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._post(("stop",))
        _reap(self.proc, grace_s=5.0)
        self._reader.join(timeout=10)  # it reads EOF now that the engine process is gone
        self._conn.close()

    def _post(self, cmd: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(cmd)
        except (OSError, ValueError):  # the engine process is gone: the reader fails every caller
            pass

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            try:
                kind = msg[0]
                if kind == "step":
                    _, chunks, stats, finished, state = msg
                    self._step_stats.extend(stats)
                    self._finished.extend(finished)
                    self._state = state
                    self.deliver(chunks)
                elif kind == "admitted":
                    self.admitted(msg[1], msg[2])
                elif kind == "state":
                    self._state = msg[1]
                else:
                    raise ValueError(f"unknown message {kind!r}")
            except Exception:  # a bug here would leave callers waiting: end the engine instead
                log.exception("bad message from the engine process")
                break
        if not self._stopping and self.proc.poll() is None:
            self.proc.kill()
        rc = _reap(self.proc, grace_s=2.0)
        if not self._stopping:
            log.error("engine process %d exited (code %s); failing its requests", self.proc.pid, rc)
        self._engine_gone(f"engine process exited (code {rc}); the replica is being replaced, retry"
                          if not self._stopping else "replica shutting down")


def _wait_ready(conn: Connection, proc: subprocess.Popen, timeout_s: float) -> dict:
    end = time.monotonic() + timeout_s
    while not conn.poll(1.0):
        if proc.poll() is not None:
            raise RuntimeError(f"the engine process exited with code {proc.returncode} while loading the models "
                               "(its log lines are above, in the replica's log)")
        if time.monotonic() > end:
            raise RuntimeError(f"the engine process did not load the models within {timeout_s:.0f} s")
    try:
        msg = conn.recv()
    except EOFError:
        raise RuntimeError(f"the engine process exited with code {proc.wait()} while loading the models") from None
    if msg[0] == "error":
        raise RuntimeError(f"the engine process failed to start:\n{msg[1]}")
    return msg[1]


def _reap(proc: subprocess.Popen, grace_s: float = 0.0):
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# ---- the engine process -------------------------------------------------------------------------
class _ConnSink:
    """The core's outputs, sent to the replica (only the engine thread sends after ``ready``)."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.core: EngineCore | None = None

    def admitted(self, request_id: str, err: str | None) -> None:
        self._send(("admitted", request_id, err))

    def deliver(self, chunks) -> None:
        core = self.core
        self._send(("step", chunks, _drain(core.step_stats), _drain(core.finished), core.state()))

    def after_commands(self) -> None:
        self._send(("state", self.core.state()))

    def _send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except OSError:  # the replica is gone
            os._exit(0)


def _exit_with_the_replica(parent: int) -> None:
    """The engine process never outlives the replica that started it, even mid-load (when
    nothing reads the socket yet)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def _die(why: str) -> None:
    """The engine thread died: exit, so the replica sees EOF and fails every caller."""
    log.error("%s; the engine process exits", why)
    logging.shutdown()
    os._exit(1)


def main(fd: int) -> int:
    threading.Thread(target=_exit_with_the_replica, args=(os.getppid(),), daemon=True).start()
    conn = Connection(fd)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s adaptspec-engine[%(process)d] %(name)s: %(message)s")
    try:
        raw = conn.recv()
    except EOFError:
        return 0
    try:
        from adaptspec.serve.faults import guard_proposers

        cfg = ServiceConfig.model_validate(raw)
        engine = build_engine(cfg)
        guards = guard_proposers(engine, inject=cfg.faults)
        warn_slow_bf16(cfg)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return 1
    sink = _ConnSink(conn)
    core = sink.core = EngineCore(engine, sink, faults_fn=lambda: sum(g.faults for g in guards), on_death=_die,
                                  stall_timeout_s=cfg.engine.stall_timeout_s)
    conn.send(("ready", {"drafters": core.drafters, "max_num_seqs": engine.config.max_num_seqs,
                         "tokenizer": engine.tokenizer}))
    core.start()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the replica stopped or died
            break
        if msg[0] == "snapshot":
            core.snapshot = msg[1]
        elif msg[0] == "stop":
            break
        else:
            core.post(msg)
    logging.shutdown()
    os._exit(0)  # now, even mid-step: nobody is left to read the outputs


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
