"""The engine on a thread of its own, shared by many asyncio callers. Ray-free.

The engine is not thread-safe, so only one thread touches it: ``EngineCore``'s. Callers
post commands (add, abort) to its inbox, which it drains between steps, and it hands each
request's outputs back through a sink. Before every step it sets each request's arm from
the latest ``PolicySnapshot`` (a plain attribute read; no RPC per token).

Two caller sides share ``generate`` and its rules (``_Callers``):

- ``EngineLoop``: the core runs in this process (tests, the Ray-free engine loop, and the
  replica when ``engine.isolation`` is ``thread``);
- ``ProcessEngineLoop`` (``adaptspec/serve/engine_proc.py``): the core runs in an engine
  process of its own next to the replica, so the replica's Python (Serve's request
  handling, metrics, the controller report) never waits on, or makes wait, the engine
  thread for the GIL.

Async-generator rules of ``generate`` (the engine protocol the deployment uses): the first
item is either an ``EngineChunk`` with ``error`` set (the request was refused: nothing
runs) or the first tokens (for a unary request, ``stream`` false, only the final chunk,
carrying every token: the engine posts nothing before it); the last item has
``finished=True``; if the consumer stops iterating (cancel, deadline, disconnect) the
request is aborted and its KV slot freed before the next step.
"""
from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

from adaptspec.control.types import Arm
from adaptspec.serve.types import (
    INTERNAL, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, ClassDelta, EngineChunk, EngineRequest, ErrorInfo,
    PolicySnapshot, ReplicaState,
)

MAX_FAILED_STEPS = 3  # consecutive failed steps after which the engine counts as gone (the replica is replaced)

log = logging.getLogger(__name__)


# ---- the engine side ----------------------------------------------------------------------
@dataclass(slots=True)
class _Meta:
    request_class: str
    fixed_arm: bool
    text_deltas: bool


class EngineCore:
    """Owns the engine and its thread. ``sink`` receives, on that thread:
    ``admitted(request_id, error_or_None)`` once per added request, ``deliver(chunks)`` after
    every step (the chunks to hand out; may be empty) and ``after_commands()`` after a drain
    of the inbox that changed something."""

    def __init__(self, engine, sink, *, faults_fn=None, on_death=None, stall_timeout_s: float = 300.0):
        self.engine = engine
        self.sink = sink
        self.on_death = on_death  # called with the reason if the engine thread dies of an error
        self.snapshot = PolicySnapshot()
        self.drafters = ("none", *engine.proposers)
        self.step_stats: collections.deque = collections.deque(maxlen=100_000)
        self.finished: collections.deque = collections.deque(maxlen=100_000)  # (class, reason, tokens)
        self._faults_fn = faults_fn or (lambda: 0)
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._meta: dict[str, _Meta] = {}
        self._stop = False
        self._failed_steps = 0
        self.stall_timeout_s = stall_timeout_s
        self._step_started: float | None = None  # monotonic start of the step running now
        engine.step_listeners.append(self.step_stats.append)
        self._thread = threading.Thread(target=self._main, name="adaptspec-engine", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="adaptspec-engine-watchdog", daemon=True)

    def start(self) -> EngineCore:
        self._thread.start()
        self._watchdog.start()
        return self

    def _watch(self) -> None:
        """A step that never returns (a hung device, a drafter call stuck inside it) keeps the
        thread alive but serves nobody: past ``stall_timeout_s`` the engine counts as gone."""
        while not self._stop:
            time.sleep(min(1.0, self.stall_timeout_s / 4))
            started = self._step_started
            if started is not None and time.monotonic() - started > self.stall_timeout_s and not self._stop:
                self._stop = True
                log.error("engine step stalled for over %.0f s", self.stall_timeout_s)
                if self.on_death is not None:
                    self.on_death(f"engine stalled: a step has not returned in {self.stall_timeout_s:.0f} s; "
                                  "the replica is being replaced, retry")
                return

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def post(self, cmd: tuple) -> None:
        """("add", EngineRequest) or ("abort", request_id); any thread. Stamped as posted: a
        request taken after the step in progress counts that wait in its TTFT (the engine's
        timings, the TTFT metric), as a client sees it."""
        self._inbox.append((*cmd, time.perf_counter()))
        self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def state(self) -> ReplicaState:
        """The engine's side of the replica's state (``replica_id`` and ``in_flight`` are the caller's)."""
        return engine_state(self.engine, self._faults_fn())

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # a bug outside a step: nothing can run any more, so say so
            log.exception("engine thread died")
            self._stop = True
            if self.on_death is not None:
                self.on_death(f"engine thread died: {type(exc).__name__}: {exc}")

    def _run(self) -> None:
        eng = self.engine
        while not self._stop:
            if self._drain_inbox():
                self.sink.after_commands()
            if not eng.has_unfinished():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            self._apply_arms()
            self._step_started = time.monotonic()
            try:
                outs = eng.step()
            except Exception as exc:  # an engine bug: fail every live request, never lose one
                log.exception("engine step failed")
                self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                self._failed_steps += 1
                if self._failed_steps >= MAX_FAILED_STEPS:  # a sticky error: stop taking requests
                    raise RuntimeError(f"{self._failed_steps} engine steps in a row failed, the last with "
                                       f"{type(exc).__name__}: {exc}") from exc
                continue
            finally:
                self._step_started = None
            if self._stop:  # the watchdog gave up on this step: its callers have been told
                return
            self._failed_steps = 0
            self.sink.deliver([c for c in map(self._chunk, outs) if c is not None])

    def _drain_inbox(self) -> bool:
        changed = False
        while self._inbox:
            changed = True
            op, a, posted = self._inbox.popleft()
            if op == "add":
                req: EngineRequest = a
                err = None
                try:
                    spec = _spec(req.arm or self.snapshot.arm_for(req.request_class), self.drafters)
                    # tokenized here: the tokenizer is not safe to share across threads
                    self.engine.add_request(req.prompt_token_ids or req.prompt, req.params, spec,
                                            request_id=req.request_id, request_class=req.request_class,
                                            raw=req.raw, arrival_s=posted)
                    self._meta[req.request_id] = _Meta(req.request_class, req.arm is not None, req.stream)
                except ValueError as exc:  # bad input: the message names the field
                    err = str(exc)
                except Exception as exc:  # anything else fails this request alone; the engine goes on
                    log.exception("request %s could not start", req.request_id)
                    if req.request_id in self.engine.requests:
                        self.engine.abort(req.request_id)
                    err = ErrorInfo(INTERNAL, f"request could not start: {type(exc).__name__}: {exc}")
                self.sink.admitted(req.request_id, err)
            elif op == "abort":
                if self._meta.pop(a, None) is not None:
                    self.engine.abort(a)
        return changed

    def _apply_arms(self) -> None:
        meta = self._meta
        apply_arms(self.engine, self.snapshot, self.drafters,
                   lambda rid: (m := meta.get(rid)) is not None and not m.fixed_arm)

    def _chunk(self, out) -> EngineChunk | None:
        meta = self._meta.get(out.request_id)
        if meta is None or not (out.finished or meta.text_deltas):
            return None  # unary: only the final chunk wakes the caller, with every token
        new_ids = out.new_token_ids if meta.text_deltas else out.token_ids
        chunk = EngineChunk(out.request_id, list(new_ids), finished=out.finished,
                            finish_reason=out.finish_reason or "", prompt_tokens=len(out.prompt_token_ids),
                            completion_tokens=len(out.token_ids))
        if out.finished:
            del self._meta[out.request_id]
            self.finished.append((meta.request_class, chunk.finish_reason, chunk.completion_tokens))
            chunk.text = out.text  # the whole text; generate() turns it into the last delta when streaming
            chunk.all_token_ids = list(out.token_ids)
            st = out.stats
            if st is not None:
                chunk.drafted, chunk.accepted, chunk.steps = st.drafted, st.accepted, st.steps
                chunk.cached_prompt_tokens = int(st.cached_prompt_tokens or 0)
                chunk.mean_accepted_length = st.mean_accepted_length
                chunk.arms = dict(st.arms)
            chunk.ttft_s, chunk.e2e_s = out.ttft_s or 0.0, out.e2e_s or 0.0
        return chunk

    def _fail_all(self, message: str) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
        rids, self._meta = list(self._meta), {}
        self.sink.deliver([_failed(rid, message) for rid in rids])


# ---- the callers' side ----------------------------------------------------------------------
@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    admitted: asyncio.Future
    text_deltas: bool
    text: str = ""
    stop: tuple[str, ...] = ()  # the request's stop strings: their beginnings are held back
    # incremental detokenization: ``decoded`` is the text of ids[:read]; only ids[prefix:]
    # are decoded again per chunk (a whole-output decode per chunk grows quadratically)
    decoded: str = ""
    prefix: int = 0
    read: int = 0


class _Callers:
    """``generate`` and the delivery to callers' event loops; subclasses post to a core."""

    # SLO-aware admission (set by the replica from ``ServiceConfig.admission``; None: off). Its
    # units here are requests: requests waiting for their first token ahead of a new one, and
    # prefills a second while requests wait (from the step stats the reports collect)
    admission = None
    _running = 0  # requests in the engine's last verification pass

    def __init__(self, *, drafters: tuple[str, ...], max_in_flight: int, replica_id: str, detok):
        self.drafters = drafters
        self.max_in_flight = max_in_flight
        self.replica_id = replica_id
        self._detok = detok  # a tokenizer for text deltas, used on the callers' event loops
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams (admission count) and _dead
        self._dead: str | None = None  # why the engine is gone (no request can be admitted)
        self._step_stats: collections.deque = collections.deque(maxlen=100_000)
        self._finished: collections.deque = collections.deque(maxlen=100_000)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def tokenizer(self):
        """The replica's copy of the engine's tokenizer (text deltas, the HTTP API's chat template);
        use it on the callers' event loop only."""
        return self._detok

    def _post(self, cmd: tuple) -> None:
        raise NotImplementedError

    async def generate(self, req: EngineRequest):
        if req.arm is not None and req.arm.drafter not in self.drafters:
            yield _error(req, INVALID_ARGUMENT, f"speculation.drafter: {req.arm.drafter!r} is not available here "
                                                f"(drafters: {', '.join(self.drafters)})")
            return
        loop = asyncio.get_running_loop()
        refused = None
        with self._lock:
            if self._dead is not None:
                refused = _error(req, UNAVAILABLE, self._dead)
            elif len(self._streams) >= self.max_in_flight:
                refused = _error(req, RESOURCE_EXHAUSTED, f"queue full: {self.max_in_flight} requests in flight on "
                                                          f"replica {self.replica_id}; retry later")
            elif self.admission is not None and not self.admission.admit(
                    req.request_class, 1, max(len(self._streams) - self._running, 0)):
                refused = _error(req, RESOURCE_EXHAUSTED, f"request_class {req.request_class!r}: the requests waiting on "
                                                          f"replica {self.replica_id} would hold this one past its TTFT "
                                                          "target; retry later or elsewhere")
            else:
                stream = _Stream(loop, asyncio.Queue(), loop.create_future(), req.stream, stop=tuple(req.params.stop))
                self._streams[req.request_id] = stream
        if refused is not None:
            yield refused
            return
        finished = False
        try:
            self._post(("add", req))
            err = await stream.admitted
            if isinstance(err, ErrorInfo):
                yield _error(req, err.code, err.message)
                return
            if err is not None:
                yield _error(req, INVALID_ARGUMENT, _field_message(err))
                return
            ids: list[int] = []
            while True:
                chunk: EngineChunk = await stream.queue.get()
                finished = chunk.finished
                if req.stream and chunk.error is None:  # text deltas here, off the engine thread
                    ids += chunk.token_ids
                    self._text_delta(stream, chunk, ids)
                yield chunk
                if finished:
                    return
        finally:
            if not finished:  # cancelled, deadline passed, consumer gone, or refused
                self._post(("abort", req.request_id))
            with self._lock:
                self._streams.pop(req.request_id, None)

    def _text_delta(self, stream: _Stream, chunk: EngineChunk, ids: list[int]) -> None:
        """The text a chunk adds. Held back until the next chunk: a partial multi-byte
        character, and an ending that could be the beginning of a stop string (the engine cuts
        a matched stop string from the final text, so what was streamed stays a prefix of it)."""
        if chunk.finished:
            text = chunk.text
        else:
            # decode from a few tokens back (``prefix``) so that a character split over tokens,
            # or a tokenizer's joining rule, sees its neighbours; append only what is new
            before = self._detok.decode(ids[stream.prefix:stream.read], skip_special_tokens=True)
            after = self._detok.decode(ids[stream.prefix:], skip_special_tokens=True)
            if len(after) > len(before) and not after.endswith("\ufffd") and after.startswith(before):
                stream.decoded += after[len(before):]
                stream.prefix, stream.read = max(stream.read - 4, 0), len(ids)
            text = stream.decoded
            text = text[:len(text) - _stop_prefix_len(text, stream.stop)]
            if text.endswith("\ufffd") or len(text) < len(stream.text):
                chunk.text = ""
                return
        if text.startswith(stream.text):
            chunk.text = text[len(stream.text):]
        else:  # cannot happen with the hold-back above; never send the streamed text twice
            log.warning("request %s: final text does not extend the streamed text", chunk.request_id)
            chunk.text = text[len(stream.text):] if len(text) > len(stream.text) else ""
        stream.text = text

    def take_step_stats(self) -> list:
        steps = _drain(self._step_stats)
        if self.admission is not None:
            for st in steps:
                self.admission.observe(st.wall_s, st.num_prefill, st.backlog > 0)
            if steps:
                self._running = steps[-1].batch_size
        return steps

    def take_finished(self) -> list[tuple[str, str, int]]:
        return _drain(self._finished)

    # the sink's calls that reach callers (engine thread or the engine process's reader)
    def admitted(self, request_id: str, err: str | None) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            _call_soon(stream, _set_result, stream.admitted, err)

    def deliver(self, chunks: list[EngineChunk]) -> None:
        for chunk in chunks:
            stream = self._streams.get(chunk.request_id)
            if stream is not None:
                _call_soon(stream, stream.queue.put_nowait, chunk)

    def after_commands(self) -> None:
        pass

    def _engine_gone(self, why: str) -> None:
        """Every caller gets UNAVAILABLE (another replica can serve a retry); later requests
        are refused with it, and the replica's health check fails, so Serve replaces it."""
        with self._lock:
            self._dead = why
            streams = list(self._streams.items())
        for rid, stream in streams:
            _call_soon(stream, _fail_stream, stream, _failed(rid, why, UNAVAILABLE))


class EngineLoop(_Callers):
    """The engine core on a thread of this process."""

    def __init__(self, engine, *, max_queued: int, replica_id: str = "local", faults_fn=None,
                 stall_timeout_s: float = 300.0):
        self.engine = engine
        super().__init__(drafters=("none", *engine.proposers), max_in_flight=engine.config.max_num_seqs + max_queued,
                         replica_id=replica_id, detok=copy.deepcopy(engine.tokenizer))
        self.core = EngineCore(engine, self, faults_fn=faults_fn, on_death=self._engine_gone,
                               stall_timeout_s=stall_timeout_s)
        self._step_stats, self._finished = self.core.step_stats, self.core.finished
        self.core.start()

    @property
    def snapshot(self) -> PolicySnapshot:
        return self.core.snapshot

    @snapshot.setter
    def snapshot(self, snap: PolicySnapshot) -> None:
        self.core.snapshot = snap

    @property
    def alive(self) -> bool:
        return self.core.alive

    def state(self) -> ReplicaState:
        return dataclasses.replace(self.core.state(), replica_id=self.replica_id, in_flight=len(self._streams))

    def stop(self) -> None:
        self.core.stop()
        self._engine_gone("replica shutting down")

    def _post(self, cmd: tuple) -> None:
        self.core.post(cmd)


def engine_state(eng, drafter_faults: int = 0) -> ReplicaState:
    """A replica's state as its engine sees it (``replica_id`` and ``in_flight`` left to the caller)."""
    last = eng.last_step
    return ReplicaState("", batch_size=last.batch_size if last else 0, num_waiting=last.backlog if last else 0,
                        steps=eng.step_count, drafter_faults=drafter_faults,
                        verify_tokens=last.verify_tokens if last else 0,
                        context_tokens=last.context_tokens if last else 0, free_slots=eng.free_seqs)


def slo_admission(config):
    """The replica's SLO-aware admission from ``ServiceConfig.admission`` (None: off, or no
    class has a TTFT target)."""
    from adaptspec.control.admission import SloAdmission

    ttft = {c.name: c.ttft_s for c in config.classes if c.ttft_s is not None}
    return SloAdmission(ttft, config.admission.slack) if config.admission.enabled and ttft else None


def apply_arms(eng, snap: PolicySnapshot, drafters: tuple[str, ...], follows=lambda request_id: True) -> None:
    """Before a step: every request that ``follows`` the policy takes its class's arm in ``snap``."""
    for rid, seq in eng.requests.items():
        if not follows(rid):
            continue
        arm = snap.arm_for(seq.request_class)
        if (seq.spec.drafter != arm.drafter or seq.spec.k != arm.k
                or getattr(seq.spec, "min_confidence", 0.0) != arm.min_confidence):
            eng.set_spec(rid, _spec(arm, drafters))


def class_deltas(step_stats: list) -> dict[str, ClassDelta]:
    """Per-class counters from engine ``StepStats`` (read by attribute)."""
    out: dict[str, ClassDelta] = {}
    for st in step_stats:
        for r in st.requests:
            d = out.get(r.request_class)
            if d is None:
                d = out[r.request_class] = ClassDelta(r.request_class)
            d.drafted += r.drafted
            d.accepted += r.accepted
            d.emitted += r.emitted
            d.steps += 1
    return out


def _drain(q: collections.deque) -> list:
    out = []
    while q:
        out.append(q.popleft())
    return out


def _spec(arm: Arm, drafters: tuple[str, ...]):
    from adaptspec.engine.params import SpecConfig

    if arm.k == 0 or arm.drafter not in drafters:
        return SpecConfig("none", 0)
    if arm.min_confidence:  # per-token draft stopping (the controller's threshold for the class)
        return SpecConfig(arm.drafter, arm.k, arm.min_confidence)
    return SpecConfig(arm.drafter, arm.k)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _call_soon(stream: _Stream, fn, *args) -> None:
    try:
        stream.loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that caller's event loop is closed: nobody is left to tell
        pass


def _fail_stream(stream: _Stream, chunk: EngineChunk) -> None:
    _set_result(stream.admitted, None)  # a caller still waiting for admission reads the error next
    stream.queue.put_nowait(chunk)


def _failed(request_id: str, message: str, code: str = INTERNAL) -> EngineChunk:
    return EngineChunk(request_id, finished=True, finish_reason="error", error=ErrorInfo(code, message))


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest ending of ``text`` that begins one of ``stops`` (0: none)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def _error(req: EngineRequest, code: str, message: str) -> EngineChunk:
    return EngineChunk(req.request_id, finished=True, finish_reason="error", error=ErrorInfo(code, message))


def _field_message(msg: str) -> str:
    """Engine messages name engine fields; the API calls max_new_tokens max_tokens."""
    return msg.replace("max_new_tokens", "max_tokens")
