"""Service metrics through ``ray.serve.metrics`` (names ``adaptspec_*``; Ray's exporter
adds its ``ray_`` prefix, so Prometheus sees ``ray_adaptspec_*``). Serve adds the
deployment, replica and application tags; Ray's own metrics stay on.

Where each series is recorded:
- per engine step (from the engine's ``StepStats``, in the replica's report task, never
  inside the engine's token loop): drafted / accepted tokens, accepted length, chosen k,
  step time, running batch, queue depth, KV-cache usage;
- per report (the replica's state and its ``PolicySnapshot``): KV slots in use, requests
  in flight, the arm the policy chose for each class;
- per request (by the ingress when the final chunk arrives): TTFT, TPOT, end-to-end
  latency, finished requests, and refusals by status code (admission rejections are
  ``RESOURCE_EXHAUSTED``).

``METRICS`` lists every exported name with its kind; the alert rules and the Grafana
dashboard in ``deploy/`` are checked against it by the tests.
"""
from __future__ import annotations

from ray.serve import metrics

ACCEPTED_LENGTH_BOUNDS = [float(x) + 0.5 for x in range(1, 18)]
K_BOUNDS = [float(x) + 0.5 for x in range(0, 17)]
STEP_BOUNDS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0]
# latency buckets from a fast GPU token (ms) to a long CPU request (minutes)
TTFT_BOUNDS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BOUNDS = [0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0]
E2E_BOUNDS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0]

# name (as exported, before Ray's ``ray_`` prefix) -> (kind, tag keys of ours); Serve adds
# ``application``, ``deployment`` and ``replica``. Counters export ``_total``, histograms
# ``_bucket``, ``_sum`` and ``_count``. The alert rules and the dashboard are checked against it.
_C, _CD = ("request_class",), ("request_class", "drafter")
METRICS = {
    "adaptspec_requests": ("counter", ("request_class", "finish_reason")),
    "adaptspec_refused_requests": ("counter", ("request_class", "code")),
    "adaptspec_drafted_tokens": ("counter", _CD),
    "adaptspec_accepted_tokens": ("counter", _CD),
    "adaptspec_emitted_tokens": ("counter", _C),
    "adaptspec_drafter_faults": ("counter", ()),
    "adaptspec_paced_steps": ("counter", ()),
    "adaptspec_accepted_length": ("histogram", _CD),
    "adaptspec_chosen_k": ("histogram", _CD),
    "adaptspec_step_seconds": ("histogram", ()),
    "adaptspec_ttft_seconds": ("histogram", _C),
    "adaptspec_tpot_seconds": ("histogram", _C),
    "adaptspec_e2e_seconds": ("histogram", _C),
    "adaptspec_batch_size": ("gauge", ()),
    "adaptspec_queue_depth": ("gauge", ()),
    "adaptspec_in_flight": ("gauge", ()),
    "adaptspec_kv_cache_usage": ("gauge", ()),
    "adaptspec_kv_slots_used": ("gauge", ()),
    "adaptspec_goodput_tokens_per_second": ("gauge", ()),
    "adaptspec_policy_k": ("gauge", _C),
    "adaptspec_policy_drafter": ("gauge", _CD),
}


class ServiceMetrics:
    def __init__(self, config=None) -> None:
        """``config``: the replica's ``ServiceConfig`` (KV capacity, classes, drafters); without
        it the KV usage ratio and the per-class policy gauges are not recorded."""
        self.config = config
        cls_drafter = ("request_class", "drafter")
        self.requests = metrics.Counter("adaptspec_requests", description="finished requests",
                                        tag_keys=("request_class", "finish_reason"))
        self.refused = metrics.Counter(
            "adaptspec_refused_requests", description="requests refused before or instead of running, by gRPC status "
                                                      "(RESOURCE_EXHAUSTED: the replica's queue was full)",
            tag_keys=("request_class", "code"))
        self.drafted = metrics.Counter("adaptspec_drafted_tokens", description="candidate tokens proposed",
                                       tag_keys=cls_drafter)
        self.accepted = metrics.Counter("adaptspec_accepted_tokens", description="drafted tokens the verifier kept",
                                        tag_keys=cls_drafter)
        self.emitted = metrics.Counter("adaptspec_emitted_tokens", description="output tokens",
                                       tag_keys=("request_class",))
        self.accepted_length = metrics.Histogram(
            "adaptspec_accepted_length", description="tokens emitted per request per step (accepted + 1)",
            boundaries=ACCEPTED_LENGTH_BOUNDS, tag_keys=cls_drafter)
        self.chosen_k = metrics.Histogram("adaptspec_chosen_k", description="k of the arm per request per step",
                                          boundaries=K_BOUNDS, tag_keys=cls_drafter)
        self.step_time = metrics.Histogram("adaptspec_step_seconds", description="engine step wall time",
                                           boundaries=STEP_BOUNDS)
        self.ttft = metrics.Histogram("adaptspec_ttft_seconds", description="time to first token (the request's "
                                      "arrival at the replica's engine loop, the step in progress included, to "
                                      "its first output token)", boundaries=TTFT_BOUNDS, tag_keys=("request_class",))
        self.tpot = metrics.Histogram("adaptspec_tpot_seconds", description="time per output token after the first",
                                      boundaries=TPOT_BOUNDS, tag_keys=("request_class",))
        self.e2e = metrics.Histogram("adaptspec_e2e_seconds", description="request arrival to its last token",
                                     boundaries=E2E_BOUNDS, tag_keys=("request_class",))
        self.batch_size = metrics.Gauge("adaptspec_batch_size", description="requests in the last step (running batch)")
        self.queue_depth = metrics.Gauge("adaptspec_queue_depth",
                                         description="requests waiting for a KV slot after the last step")
        self.in_flight = metrics.Gauge("adaptspec_in_flight", description="requests admitted by the replica "
                                       "(running + waiting); it refuses more past max_num_seqs + max_queued")
        self.kv_usage = metrics.Gauge("adaptspec_kv_cache_usage", description="cached tokens of the last step over "
                                      "the KV cache's capacity (max_num_seqs x max_model_len), 0-1")
        self.kv_slots = metrics.Gauge("adaptspec_kv_slots_used", description="KV slots (sequences) in use")
        self.goodput = metrics.Gauge("adaptspec_goodput_tokens_per_second",
                                     description="emitted tokens per second of step time (last report)")
        self.drafter_faults = metrics.Counter("adaptspec_drafter_faults", description="drafter errors or timeouts")
        self.paced_steps = metrics.Counter("adaptspec_paced_steps", description="engine steps whose prompt chunks "
                                           "TPOT-paced prefill cut (pacing.enabled)")
        self.policy_k = metrics.Gauge("adaptspec_policy_k", description="k of the arm the policy chose for the class",
                                      tag_keys=("request_class",))
        self.policy_drafter = metrics.Gauge(
            "adaptspec_policy_drafter", description="1 for the drafter the policy chose for the class, 0 for the "
                                                    "others (none, ngram, draft)", tag_keys=cls_drafter)

    def observe_steps(self, steps: list) -> None:
        """``steps``: engine ``StepStats`` (read by attribute)."""
        wall = emitted = 0.0
        held = 0
        for st in steps:
            self.step_time.observe(st.wall_s)
            held += bool(getattr(st, "prompts_held", False))
            wall += st.wall_s
            for r in st.requests:
                tags = {"request_class": r.request_class, "drafter": r.drafter}
                if r.drafted:
                    self.drafted.inc(r.drafted, tags)
                if r.accepted:
                    self.accepted.inc(r.accepted, tags)
                self.accepted_length.observe(r.emitted, tags)
                self.chosen_k.observe(r.k, tags)
                emitted += r.emitted
        if held:
            self.paced_steps.inc(held)
        if steps:
            last = steps[-1]
            self.batch_size.set(last.batch_size)
            self.queue_depth.set(last.num_waiting)
            self.goodput.set(emitted / wall if wall > 0 else 0.0)
            cap = self._kv_capacity()
            if cap:
                self.kv_usage.set(min(1.0, (last.context_tokens + last.verify_tokens) / cap))

    def observe_state(self, state, snapshot=None) -> None:
        """Each report: the replica's ``ReplicaState`` and the ``PolicySnapshot`` it runs on."""
        self.in_flight.set(state.in_flight)
        if self.config is not None:
            self.kv_slots.set(self.config.engine.max_num_seqs - state.free_slots)
            if state.batch_size == 0 and state.num_waiting == 0:  # idle: no step updates the step gauges
                self.batch_size.set(0)
                self.queue_depth.set(0)
                self.kv_usage.set(0.0)
        if snapshot is not None and self.config is not None:
            drafters = ("none", *self.config.drafters)
            for cls in self.config.class_names:
                arm = snapshot.arm_for(cls)
                self.policy_k.set(arm.k, {"request_class": cls})
                for d in drafters:
                    self.policy_drafter.set(1.0 if d == arm.drafter else 0.0, {"request_class": cls, "drafter": d})

    def observe_finished(self, request_class: str, finish_reason: str, completion_tokens: int) -> None:
        self.requests.inc(1, {"request_class": request_class, "finish_reason": finish_reason or "unknown"})
        if completion_tokens:
            self.emitted.inc(completion_tokens, {"request_class": request_class})

    def observe_latency(self, request_class: str, ttft_s: float, e2e_s: float, completion_tokens: int) -> None:
        """A finished request's engine-side latencies (TPOT over the tokens after the first)."""
        tags = {"request_class": request_class}
        if ttft_s > 0:
            self.ttft.observe(ttft_s, tags)
        if e2e_s > 0:
            self.e2e.observe(e2e_s, tags)
            if completion_tokens > 1 and e2e_s >= ttft_s:
                self.tpot.observe((e2e_s - ttft_s) / (completion_tokens - 1), tags)

    def observe_refused(self, request_class: str, code: str) -> None:
        self.refused.inc(1, {"request_class": request_class or "default", "code": code})

    def _kv_capacity(self) -> int:
        if self.config is None:
            return 0
        return self.config.engine.max_num_seqs * self.config.engine.max_model_len
