"""SLO-aware admission: the rule, the service's refusal, and goodput past capacity in the
simulator (with admission off as the negative control)."""
import asyncio
from pathlib import Path

import pytest

from adaptspec.control import SloAdmission

SIM = Path(__file__).resolve().parents[2] / "simulations"


def test_admits_until_the_predicted_wait_passes_slack_times_the_target():
    adm = SloAdmission({"chat": 2.0}, slack=0.8)
    assert adm.admit("chat", 500, 10_000)  # no rate measured yet: admit
    adm.observe(0.1, 400, backlog_left=False)  # work did not wait: says nothing about the rate
    assert adm.rate is None
    for _ in range(20):
        adm.observe(0.1, 400, backlog_left=True)  # 4000 prompt tokens a second while work waits
    assert adm.rate == pytest.approx(4000.0)
    assert adm.predicted_wait(500, 5500) == pytest.approx(1.5)
    assert adm.admit("chat", 500, 5500)  # 1.5 s <= 0.8 x 2 s
    assert not adm.admit("chat", 500, 6500)  # 1.75 s > 1.6 s
    assert adm.admit("batch", 500, 10**9)  # no TTFT target: always admitted
    assert adm.admit("chat", 10**6, 0)  # nothing ahead of it: its own prompt is no reason to refuse
    assert adm.refused == {"chat": 1}
    with pytest.raises(ValueError, match="slack"):
        SloAdmission({}, slack=0)
    with pytest.raises(ValueError, match="ttft_s"):
        SloAdmission({"chat": -1.0})


def test_the_service_refuses_with_resource_exhausted_and_names_the_class():
    from adaptspec.engine.params import SamplingParams
    from adaptspec.serve.config import ServiceConfig
    from adaptspec.serve.loop import _Callers, slo_admission
    from adaptspec.serve.types import RESOURCE_EXHAUSTED, EngineRequest

    assert slo_admission(ServiceConfig()) is None  # off by default
    cfg = ServiceConfig.model_validate({"admission": {"enabled": True},
                                        "classes": [{"name": "chat", "ttft_s": 1.0}, {"name": "batch"}]})
    adm = slo_admission(cfg)
    assert adm is not None and adm.ttft_s == {"chat": 1.0} and adm.slack == 0.8

    class Loop(_Callers):
        def __init__(self):
            super().__init__(drafters=("none",), max_in_flight=100, replica_id="r0", detok=None)
            self.posted = []

        def _post(self, cmd):
            self.posted.append(cmd)

    loop = Loop()
    loop.admission = adm
    for _ in range(10):  # the engine started 2 requests a second while others waited
        adm.observe(0.5, 1, backlog_left=True)
    loop._running = 4
    loop._streams = {f"r{i}": None for i in range(8)}  # 8 in flight, 4 running: 4 wait

    async def first(req):
        agen = loop.generate(req)
        item = await agen.__anext__()
        await agen.aclose()
        return item

    chat = EngineRequest("q1", "chat", SamplingParams(max_new_tokens=4), prompt="hi")
    out = asyncio.run(first(chat))
    # 5 ahead (4 waiting and this one) at 2 a second: 2.5 s > 0.8 x 1 s
    assert out.error is not None and out.error.code == RESOURCE_EXHAUSTED and "'chat'" in out.error.message
    assert not loop.posted  # refused at once: nothing reached the engine
    # a class without a TTFT target is not refused
    batch = EngineRequest("q2", "batch", SamplingParams(max_new_tokens=4), prompt="hi")
    agen = loop.generate(batch)

    async def started():
        task = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(started())
    assert loop.posted and loop.posted[0][0] == "add"


def test_past_capacity_admission_keeps_goodput_and_without_it_goodput_collapses():
    from adaptspec.sim.runner import run_scenario
    from adaptspec.sim.scenario import load_scenario

    sc, base = load_scenario(SIM / "overload_2x.yaml")
    keep = [p for p in sc.policies if p.kind == "static" and p.drafter == "draft"]
    assert {p.admission for p in keep} == {None, False}  # with the scenario's admission, and without
    short = sc.model_copy(update={"duration_s": 90.0, "warmup_s": 20.0, "drain_s": 30.0, "policies": keep,
                                  "sweep": sc.sweep.model_copy(update={"rps": [48.0]})})
    runs = {r.policy: r for r in run_scenario(short, base, seed=0).runs}
    on, off = runs["static-draft:2"], runs["static-draft:2-no-admission"]
    assert on.refused > 0 and off.refused == 0
    assert off.goodput_rps < 0.2 * on.goodput_rps  # the control: queued to fail
    assert on.goodput_rps > 15.0  # requests/s meeting their SLOs at twice capacity (about 24/s)
