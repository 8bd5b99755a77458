"""Closed-loop load on the engine and the controller in one process: no Ray cluster, no gRPC.

``adaptspec loadtest --in-process`` drives the same engine (``build_engine``) and the same
controller (``ControlCore``) as a replica does, the way a replica does (each step takes the
arms of the latest policy snapshot; the step stats go to the controller every
``controller.report_interval_s`` as a ``ReplicaReport``), from the same prompts and classes
as the gRPC load test. What it leaves out is Serve and gRPC, whose work shares the CPU with
the engine on a small machine and makes runs noisier: it answers "which policy, and is the
controller's model of the step right?" in minutes. The controller's ``CostCheck`` compares its
predicted step times with the measured ones (the check that found the prefill pass booked as
overhead, 2026-12-01). ``decode`` counts, per (policy, concurrency), the tokens the steps
emitted and the steps' seconds less their prefill pass, over the reports inside the measured
windows: tokens per decode-second, which the prompt mix does not move (with short answers
prefill is half of the time, and which prompts come up in a window moves tokens/s by more
than the arms do at 4 clients).
"""
from __future__ import annotations

import heapq
import time

import numpy as np

from adaptspec import SamplingParams
from adaptspec.control.types import StepOutcome
from adaptspec.serve.config import ServiceConfig
from adaptspec.serve.controller import ControlCore, PolicyUpdate
from adaptspec.serve.loadtest import (Arrivals, LoadSpec, RequestRecord, Window, as_arrivals,
                                      pick_prompt, with_context)
from adaptspec.serve.loop import _spec, apply_arms, class_deltas, engine_state
from adaptspec.serve.types import ReplicaReport


class InProcessService:
    """One replica's engine and the controller, in this process; the load test's service side."""

    def __init__(self, cfg: ServiceConfig, *, torch_threads: int | None = None):
        from adaptspec.serve.engine_proc import build_engine

        self.cfg = cfg
        self.engine = build_engine(cfg, torch_threads=torch_threads)
        self.core = ControlCore(cfg)
        self.drafters = ("none", *self.engine.proposers)
        self._steps: list = []
        self.engine.step_listeners.append(self._steps.append)
        self.decode: dict[tuple[str, str], list[float]] = {}  # (policy, level label) -> [tokens, seconds]
        self.step_walls: dict[int, list[float]] = {}  # id(decode tally) -> wall seconds of its measured steps
        # request id -> its prompt's index in its class's pool (an acceptance recorder keys on it)
        self.prompt_of: dict[str, int] = {}

    def policy(self) -> str:
        return self.core.policy_name

    def usage(self) -> tuple[float, None, dict]:
        """The controller's counters, as ``cli.controller_usage`` reads them off the service (no
        process CPU: the controller shares this process with the engine)."""
        check = self.core.cost_checks.get(self.core.policy_name)
        return self.core.policy_cpu_s, None, {k: tuple(v) for k, v in check.rows.items()} if check else {}

    def update_policy(self, name: str, reset: bool = False) -> None:
        self.core.update(PolicyUpdate(policy=name, reset=reset))

    def run_level(self, concurrency: int | Arrivals, duration_s: float, spec: LoadSpec,
                  warmup_s: float = 0.0) -> tuple[list[RequestRecord], Window]:
        """``concurrency`` requests in flight for ``warmup_s`` + ``duration_s`` (a finished one
        is replaced at once, as a closed-loop client does), or the ``Arrivals`` given (a
        client's think time; open-loop arrival times); a request's clock starts when it is
        due, so one due during a step waits for the step, as it would in a replica. Requests
        still running at the end are aborted and counted as cut."""
        eng, core = self.engine, self.core
        arr = as_arrivals(concurrency)
        prompts = spec.pools()
        interval = self.cfg.controller.report_interval_s
        tally = self.decode.setdefault((core.policy_name, arr.label), [0.0, 0.0])
        records: dict[str, RequestRecord] = {}
        done: list[RequestRecord] = []
        counter = 0
        params = SamplingParams(max_new_tokens=spec.max_tokens,
                                **({} if spec.temperature is None else {"temperature": spec.temperature}))
        snap = core.snapshot()  # as a replica: the arms of its last report, refreshed at the next

        def add(due: float) -> None:
            nonlocal counter
            cls, idx, prompt = pick_prompt(prompts, spec.classes, counter)
            if spec.prompt_tokens:
                prompt = with_context(prompt, counter, spec.prompt_tokens)
            counter += 1
            rid = eng.add_request(prompt, params, _spec(snap.arm_for(cls), self.drafters), request_class=cls)
            self.prompt_of[rid] = idx
            records[rid] = RequestRecord(cls, 0.0, 0.0, 0, start_s=due, prompt_index=idx)

        offsets = arr.times(warmup_s + duration_s) if arr.open else np.zeros(arr.clients)  # before the clock
        t0 = time.perf_counter()
        window = Window(t0 + warmup_s, t0 + warmup_s + duration_s)
        # when each next request is due (perf_counter): open loop, all of them; closed loop, one per
        # client waiting to send
        due = list(t0 + offsets)
        heapq.heapify(due)
        think = np.random.default_rng([arr.seed, 2])
        last = time.perf_counter()
        self._steps.clear()
        while time.perf_counter() < window.end_s:
            now = time.perf_counter()
            while due and due[0] <= now:
                add(heapq.heappop(due))
            if not records:  # nothing in flight: idle until the next request is due
                time.sleep(max(min(due[0] if due else window.end_s, window.end_s) - now, 0.0))
                continue
            apply_arms(eng, snap, self.drafters)
            outs = eng.step()
            now = time.perf_counter()
            for o in outs:
                rec = records.get(o.request_id)
                if rec is None:
                    continue
                if o.new_token_ids:
                    if not rec.ttft_s:
                        rec.ttft_s = now - rec.start_s
                    rec.chunks.append((now, len(o.new_token_ids)))
                    rec.tokens += len(o.new_token_ids)
                if o.finished:
                    rec.e2e_s = now - rec.start_s
                    rec.arms = dict(o.stats.arms) if o.stats is not None else {}
                    rec.cached_tokens = int(getattr(o.stats, "cached_prompt_tokens", 0) or 0)
                    done.append(records.pop(o.request_id))
                    self.prompt_of.pop(o.request_id, None)  # the recorders heard this step already
                    if not arr.open:
                        heapq.heappush(due, now + arr.pause(think))
            if now - last >= interval:
                snap = self._report(now - last, tally if now in window else None)
                last = now
        now = time.perf_counter()
        for rid, rec in records.items():  # still running at the end: cut, as the gRPC test cancels them
            eng.abort(rid)
            self.prompt_of.pop(rid, None)
            rec.e2e_s, rec.cut = now - rec.start_s, True
            done.append(rec)
        self._report(now - last, tally)
        return done, window

    def step_wall(self, policy: str, level: str) -> tuple[float, float]:
        """(median, max) wall seconds of the engine steps measured at that level."""
        walls = self.step_walls.get(id(self.decode.get((policy, level))), [])
        return (float(np.median(walls)), max(walls)) if walls else (0.0, 0.0)

    def _report(self, interval_s: float, tally: list[float] | None):
        """Send the steps since the last report to the controller; returns its new snapshot."""
        steps, self._steps[:] = list(self._steps), []
        if not steps:
            return self.core.snapshot()
        if tally is not None:
            tally[0] += sum(s.emitted for s in steps)
            tally[1] += sum(s.wall_s - s.prefill_s for s in steps)
            self.step_walls.setdefault(id(tally), []).extend(s.wall_s for s in steps)
        outcomes = [StepOutcome.from_step_stats(s) for s in steps]
        state = engine_state(self.engine)
        state.replica_id = "in-process"
        return self.core.report(ReplicaReport(state, outcomes, list(class_deltas(steps).values()), interval_s))
