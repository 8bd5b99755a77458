"""The engine in a background thread, shared by many asyncio callers. Ray-free.

The engine is not thread-safe, so only the engine thread touches it: callers post
commands (add, abort) to an inbox that the thread drains between steps, and the thread
hands each request's outputs back to the caller's event loop. Before every step the
thread sets each request's arm from the latest ``PolicySnapshot`` (a plain attribute read;
no RPC per token).

Async-generator rules of ``EngineLoop.generate`` (the engine protocol the deployment uses):
the first item is either an ``EngineChunk`` with ``error`` set (the request was refused:
nothing runs) or the first tokens (for a unary request, ``stream`` false, only the final
chunk, carrying every token: the engine thread posts nothing before it); the last item has
``finished=True``; if the consumer
stops iterating (cancel, deadline, disconnect) the request is aborted and its KV slot
freed before the next step.
"""
from __future__ import annotations

import asyncio
import collections
import copy
import logging
import threading
import time
from dataclasses import dataclass

from adaptspec.control.types import Arm
from adaptspec.serve.types import (
    INTERNAL, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ClassDelta, EngineChunk, EngineRequest, ErrorInfo,
    PolicySnapshot, ReplicaState,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request_class: str
    fixed_arm: bool
    text_deltas: bool
    text: str = ""


class EngineLoop:
    def __init__(self, engine, *, max_queued: int, replica_id: str = "local", faults_fn=None):
        self.engine = engine
        self.max_in_flight = engine.config.max_num_seqs + max_queued
        self.replica_id = replica_id
        self.snapshot = PolicySnapshot()
        self._faults_fn = faults_fn or (lambda: 0)
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._step_stats: collections.deque = collections.deque(maxlen=100_000)
        self._finished: collections.deque = collections.deque(maxlen=100_000)  # (class, reason, tokens)
        self._stop = False
        self._lock = threading.Lock()  # guards _streams (admission count)
        self._drafters = ("none", *engine.proposers)
        self._detok = copy.deepcopy(engine.tokenizer)  # the engine thread owns engine.tokenizer
        engine.step_listeners.append(self._step_stats.append)
        self._thread = threading.Thread(target=self._run, name="adaptspec-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any event loop) -----------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(self, req: EngineRequest):
        if req.arm is not None and req.arm.drafter not in self._drafters:
            yield _error(req, INVALID_ARGUMENT, f"speculation.drafter: {req.arm.drafter!r} is not available here "
                                                f"(drafters: {', '.join(self._drafters)})")
            return
        loop = asyncio.get_running_loop()
        with self._lock:
            if len(self._streams) >= self.max_in_flight:
                full = True
            else:
                full = False
                stream = _Stream(loop, asyncio.Queue(), req.request_class, req.arm is not None, req.stream)
                self._streams[req.request_id] = stream
        if full:
            yield _error(req, RESOURCE_EXHAUSTED, f"queue full: {self.max_in_flight} requests in flight on replica "
                                                  f"{self.replica_id}; retry later")
            return
        admitted = loop.create_future()
        self._post(("add", req, None, admitted))
        finished = False
        try:
            err = await admitted
            if err is not None:
                yield _error(req, INVALID_ARGUMENT, _field_message(err))
                return
            ids: list[int] = []
            while True:
                chunk: EngineChunk = await stream.queue.get()
                finished = chunk.finished
                if req.stream:  # text deltas here, off the engine thread, with our own tokenizer copy
                    ids += chunk.token_ids
                    self._text_delta(stream, chunk, ids)
                yield chunk
                if finished:
                    return
        finally:
            if not finished:  # cancelled, deadline passed, consumer gone, or refused
                self._post(("abort", req.request_id, None, None))
            with self._lock:
                self._streams.pop(req.request_id, None)

    def _text_delta(self, stream: _Stream, chunk: EngineChunk, ids: list[int]) -> None:
        text = chunk.text if chunk.finished else self._detok.decode(ids, skip_special_tokens=True)
        if chunk.finished or not text.endswith("\ufffd"):  # hold back a partial multi-byte character
            chunk.text = text[len(stream.text):] if text.startswith(stream.text) else text
            stream.text = text
        else:
            chunk.text = ""

    def take_step_stats(self) -> list:
        out = []
        while self._step_stats:
            out.append(self._step_stats.popleft())
        return out

    def take_finished(self) -> list[tuple[str, str, int]]:
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def state(self) -> ReplicaState:
        last = self.engine.last_step
        return ReplicaState(self.replica_id, batch_size=last.batch_size if last else 0,
                            num_waiting=last.num_waiting if last else 0, steps=self.engine.step_count,
                            drafter_faults=self._faults_fn(),
                            verify_tokens=last.verify_tokens if last else 0,
                            context_tokens=last.context_tokens if last else 0,
                            in_flight=len(self._streams), free_slots=len(self.engine.scheduler.free_slots))

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _post(self, cmd) -> None:
        self._inbox.append(cmd)
        self._wake.set()

    # ---- engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop:
            self._drain_inbox()
            if not eng.has_unfinished():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            self._apply_arms()
            try:
                outs = eng.step()
            except Exception as exc:  # an engine bug: fail every live request, never lose one
                log.exception("engine step failed")
                self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                continue
            for out in outs:
                self._deliver(out)

    def _drain_inbox(self) -> None:
        while self._inbox:
            op, a, b, fut = self._inbox.popleft()
            if op == "add":
                req: EngineRequest = a
                stream = self._streams.get(req.request_id)
                if stream is None:  # the caller went away before admission
                    continue
                err = None
                try:
                    spec = _spec(req.arm or self.snapshot.arm_for(req.request_class), self._drafters)
                    # tokenized here: the tokenizer is not safe to share across threads
                    self.engine.add_request(req.prompt_token_ids or req.prompt, req.params, spec,
                                            request_id=req.request_id, request_class=req.request_class,
                                            raw=req.raw)
                except ValueError as exc:
                    err = str(exc)
                stream.loop.call_soon_threadsafe(_set_result, fut, err)
            elif op == "abort":
                self.engine.abort(a)

    def _apply_arms(self) -> None:
        snap = self.snapshot
        for rid, seq in self.engine.requests.items():
            stream = self._streams.get(rid)
            if stream is None or stream.fixed_arm:
                continue
            arm = snap.arm_for(seq.request_class)
            if seq.spec.drafter != arm.drafter or seq.spec.k != arm.k:
                seq.spec = _spec(arm, self._drafters)

    def _deliver(self, out) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None or not (out.finished or stream.text_deltas):
            return  # unary: only the final chunk wakes the caller's event loop, with every token
        new_ids = out.new_token_ids if stream.text_deltas else out.token_ids
        chunk = EngineChunk(out.request_id, list(new_ids), finished=out.finished,
                            finish_reason=out.finish_reason or "", prompt_tokens=len(out.prompt_token_ids),
                            completion_tokens=len(out.token_ids))
        if out.finished:
            self._finished.append((stream.request_class, chunk.finish_reason, chunk.completion_tokens))
            chunk.text = out.text  # the whole text; generate() turns it into the last delta when streaming
            chunk.all_token_ids = list(out.token_ids)
            st = out.stats
            if st is not None:
                chunk.drafted, chunk.accepted, chunk.steps = st.drafted, st.accepted, st.steps
                chunk.mean_accepted_length = st.mean_accepted_length
                chunk.arms = dict(st.arms)
            chunk.ttft_s, chunk.e2e_s = out.ttft_s or 0.0, out.e2e_s or 0.0
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, chunk)

    def _fail_all(self, message: str) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
        for rid, stream in list(self._streams.items()):
            chunk = EngineChunk(rid, finished=True, finish_reason="error", error=ErrorInfo(INTERNAL, message))
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, chunk)


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


def _spec(arm: Arm, drafters: tuple[str, ...]):
    from adaptspec.engine.params import SpecConfig

    if arm.k == 0 or arm.drafter not in drafters:
        return SpecConfig("none", 0)
    return SpecConfig(arm.drafter, arm.k)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _error(req: EngineRequest, code: str, message: str) -> EngineChunk:
    return EngineChunk(req.request_id, finished=True, finish_reason="error", error=ErrorInfo(code, message))


def _field_message(msg: str) -> str:
    """Engine messages name engine fields; the API calls max_new_tokens max_tokens."""
    return msg.replace("max_new_tokens", "max_tokens")
