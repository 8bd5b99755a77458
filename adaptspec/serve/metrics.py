"""Service metrics through ``ray.serve.metrics`` (names ``adaptspec_*``; Ray's exporter
adds its ``ray_`` prefix, so Prometheus sees ``ray_adaptspec_*``). Serve adds the
deployment, replica and application tags; Ray's own metrics stay on.

Recorded by the TargetEngine replica from the engine's ``StepStats`` in its report task,
never inside the engine's token loop.
"""
from __future__ import annotations

from ray.serve import metrics

ACCEPTED_LENGTH_BOUNDS = [float(x) + 0.5 for x in range(1, 18)]
K_BOUNDS = [float(x) + 0.5 for x in range(0, 17)]
STEP_BOUNDS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0]


class ServiceMetrics:
    def __init__(self) -> None:
        cls_drafter = ("request_class", "drafter")
        self.requests = metrics.Counter("adaptspec_requests", description="finished requests",
                                        tag_keys=("request_class", "finish_reason"))
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
        self.batch_size = metrics.Gauge("adaptspec_batch_size", description="requests in the last step")
        self.goodput = metrics.Gauge("adaptspec_goodput_tokens_per_second",
                                     description="emitted tokens per second of step time (last report)")
        self.drafter_faults = metrics.Counter("adaptspec_drafter_faults", description="drafter errors or timeouts")

    def observe_steps(self, steps: list) -> None:
        """``steps``: engine ``StepStats`` (read by attribute)."""
        wall = emitted = 0.0
        for st in steps:
            self.step_time.observe(st.wall_s)
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
        if steps:
            self.batch_size.set(steps[-1].batch_size)
            self.goodput.set(emitted / wall if wall > 0 else 0.0)

    def observe_finished(self, request_class: str, finish_reason: str, completion_tokens: int) -> None:
        self.requests.inc(1, {"request_class": request_class, "finish_reason": finish_reason or "unknown"})
        if completion_tokens:
            self.emitted.inc(completion_tokens, {"request_class": request_class})
