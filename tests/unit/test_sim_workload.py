"""Workloads: arrival processes and schedules, length distributions, the trace reader."""
from pathlib import Path

import numpy as np
import pytest

from adaptspec.sim.scenario import ClassSpec, TraceSpec, WorkloadSpec
from adaptspec.sim.workload import arrival_times, read_trace, sample_lengths

SHARED = Path(__file__).resolve().parents[3] / "shared"


def wl(rate, **arrival):
    return WorkloadSpec.model_validate({"rate": rate, "arrival": arrival or {"process": "poisson"}})


def test_poisson_rate_and_exponential_gaps():
    t = arrival_times(wl({"kind": "constant", "rps": 20}), 1000, np.random.default_rng(0))
    assert t.size == pytest.approx(20_000, rel=0.03)
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # CV of exponential gaps = 1


def test_gamma_burstiness_sets_the_gap_variability():
    t = arrival_times(wl({"kind": "constant", "rps": 20}, process="gamma", burstiness=0.25), 1000,
                      np.random.default_rng(0))
    gaps = np.diff(t)
    assert t.size == pytest.approx(20_000, rel=0.08)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.1)  # CV = 1 / sqrt(shape)


def test_step_ramp_and_diurnal_schedules():
    rng = np.random.default_rng(1)
    t = arrival_times(wl({"kind": "step", "steps": [[0, 5], [100, 50]]}), 200, rng)
    assert (t < 100).sum() == pytest.approx(500, rel=0.15)
    assert (t >= 100).sum() == pytest.approx(5000, rel=0.05)
    t = arrival_times(wl({"kind": "ramp", "start_rps": 1, "end_rps": 41}), 200, rng)
    assert t.size == pytest.approx(21 * 200, rel=0.05)
    assert (t > 100).sum() > 2 * (t <= 100).sum()
    t = arrival_times(wl({"kind": "diurnal", "mean_rps": 10, "amplitude": 0.9, "period_s": 100}), 100, rng)
    assert (t < 50).sum() > 3 * (t >= 50).sum()  # the sine's high half, then its low half


@pytest.mark.parametrize("spec,check", [
    ({"dist": "fixed", "value": 7}, lambda x: (x == 7).all()),
    ({"dist": "uniform", "low": 3, "high": 9}, lambda x: x.min() == 3 and x.max() == 9),
    ({"dist": "lognormal", "median": 300, "sigma": 0.5}, lambda x: abs(np.median(x) - 300) < 10),
    ({"dist": "zipf", "a": 2.0, "scale": 10, "min": 10, "max": 500}, lambda x: x.min() == 10 and x.max() <= 500
     and (x == 10).mean() > 0.5),
])
def test_length_distributions(spec, check):
    from pydantic import TypeAdapter

    from adaptspec.sim.scenario import LengthSpec

    x = sample_lengths(TypeAdapter(LengthSpec).validate_python(spec), 20_000, np.random.default_rng(2))
    assert check(x)


def _classes():
    acc = {"draft": {"bernoulli": 0.5}, "ngram": {"bernoulli": 0.2}}
    return [ClassSpec.model_validate({"name": "chat", "weight": 3, "acceptance": acc}),
            ClassSpec.model_validate({"name": "code", "weight": 1, "acceptance": acc})]


def test_trace_reader_with_and_without_a_class_column(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("arrived_at,num_prefill_tokens,num_decode_tokens,request_class\n"
                 "0.0,100,10,code\n1.5,200,20,\n3.0,300,30,code\n9.0,400,40,chat\n")
    r = read_trace(TraceSpec(path="t.csv", time_scale=2.0), tmp_path, _classes(), 4.0, np.random.default_rng(0))
    assert r.arrival_s.tolist() == [0.0, 0.75, 1.5]  # 9.0 / 2 = 4.5 is past the run
    assert r.prompt_tokens.tolist() == [100, 200, 300] and r.output_tokens.tolist() == [10, 20, 30]
    assert r.class_idx[0] == 1 and r.class_idx[2] == 1  # named class kept; the blank one drawn by weight
    with pytest.raises(ValueError, match="workload.trace.path"):
        read_trace(TraceSpec(path="missing.csv"), tmp_path, _classes(), 4.0, np.random.default_rng(0))
    (tmp_path / "bad.csv").write_text("t,p\n1,2\n")
    with pytest.raises(ValueError, match="lacks columns"):
        read_trace(TraceSpec(path="bad.csv"), tmp_path, _classes(), 4.0, np.random.default_rng(0))


@pytest.mark.skipif(not (SHARED / "data" / "traces").exists(),
                    reason="../shared/data/traces is absent (a user's clone has no ../shared)")
def test_reads_the_real_conversation_trace():
    r = read_trace(TraceSpec(path=str(SHARED / "data/traces/splitwise_conv.csv")), Path("."), _classes(), 600.0,
                   np.random.default_rng(0))
    assert 2000 < len(r) < 5000  # about 5.5 requests/s
    assert np.all(np.diff(r.arrival_s) >= 0)
    assert r.prompt_tokens.min() >= 1 and r.output_tokens.max() <= 2000
