"""The GPU check's own logic, on the CPU: the tiny run end to end, its JSON, the ratio and
bandwidth-floor arithmetic, the time budget, error capture, the pytest runner."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from adaptspec.tools import gpu_check as gc


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "check.json"
    opts = gc.Options(device="cpu", tiny=True, out=out, batches=(1, 2), decode_steps=3)
    return gc.Check(opts).run(), out


def test_tiny_cpu_run_writes_one_json_with_every_section(tiny_run):
    result, out = tiny_run
    assert json.loads(out.read_text()) == json.loads(json.dumps(result, default=str))
    assert result["schema"] == gc.SCHEMA
    assert set(result) >= {"created", "options", "goals", "sections", "errors", "summary", "elapsed_s"}
    s = result["sections"]
    assert list(s) == list(gc.SECTIONS)
    assert result["errors"] == [], result["errors"]
    # CUDA-only parts are skipped with the reason, everything else ran
    assert s["tests"]["status"] == "skipped" and "CUDA" in s["tests"]["reason"]
    assert s["graphs"]["status"] == "skipped" and "CUDA" in s["graphs"]["reason"]
    for name in ("env", "bandwidth", "model", "decode", "verify_cost", "spec"):
        assert s[name]["status"] == "ok", (name, s[name])
        assert s[name]["elapsed_s"] >= 0
    assert s["env"]["versions"]["torch"] == torch.__version__
    assert s["env"]["source_digest"] and len(s["env"]["source_digest"]) == 16
    assert set(s["decode"]["by_batch"]) == {"1", "2"}
    for r in s["decode"]["by_batch"].values():
        assert r["steps"] == 3 and r["emitted"] == 3 * r["batch"] and r["tokens_per_s"] > 0
    vc = s["verify_cost"]
    assert vc["forward"]["relative"]["1"] == 1.0 and set(vc["forward"]["relative"]) == {str(n) for n in range(1, 10)}
    assert vc["engine"]["relative"]["1"] == 1.0
    runs = s["spec"]["runs"]
    # the target as its own draft in fp32: greedy accepts (nearly) everything it drafts
    assert runs["self_draft/b1"]["acceptance_rate"] >= 0.95
    assert runs["self_draft/b1"]["mean_accepted_length"] > 3
    assert runs["ngram/b1"]["drafted"] > 0
    sm = result["summary"]
    assert sm["bandwidth_floor_ms"] > 0 and sm["decode_b1_over_floor"] > 0
    assert sm["goals"]["graphs_over_eager_b1"]["met"] is None  # not measured on the CPU


def test_the_graph_sections_run_their_code_on_the_cpu(tmp_path):
    """With graphs_on_cpu the engine runs its padded static-buffer path (no capture): the
    graphs, verify-cost and n-gram-with-graphs code paths run here before a GPU sees them."""
    opts = gc.Options(device="cpu", tiny=True, out=tmp_path / "g.json", batches=(1, 2), decode_steps=3,
                      graphs_on_cpu=True, sections=("model", "decode", "graphs", "verify_cost", "spec"))
    result = gc.Check(opts).run()
    s = result["sections"]
    assert result["errors"] == [], result["errors"]
    assert s["graphs"]["status"] == "ok" and s["graphs"]["mode"] == "graphs" and s["graphs"]["cuda_graphs"] is True
    assert s["decode"]["cuda_graphs"] is False
    assert set(s["graphs"]["by_batch"]) == {"1", "2"}
    assert s["verify_cost"]["engine_graphs"]["relative"]["1"] == 1.0
    runs = s["spec"]["runs"]
    assert "ngram_graphs/b1" in runs
    # the self-draft with the target's and the draft's graphs (padded path here): the same
    # near-total acceptance as eager, so the draft's passes drafted what the target verifies
    assert runs["self_draft_graphs/b1"]["draft_graphs"] is True and runs["self_draft/b1"]["draft_graphs"] is False
    assert runs["self_draft_graphs/b1"]["acceptance_rate"] >= 0.95
    assert result["summary"]["graphs_over_eager_b1"] > 0


def test_the_printed_table_names_every_number(tiny_run):
    text = gc.table(tiny_run[0])
    for word in ("copy bandwidth", "decode (eager)", "verify n tokens / one (forward)", "spec self_draft/b1",
                 "floor:", "goal decode_b1_over_floor"):
        assert word in text


def test_ratio_and_floor_arithmetic():
    assert gc.relative({1: 2.0, 5: 2.2, 9: 4.0}) == pytest.approx({1: 1.0, 5: 1.1, 9: 2.0})
    with pytest.raises(ValueError, match="no positive cost at 1"):
        gc.relative({2: 1.0})
    assert gc.copy_bandwidth(10**9, 0.5) == 4e9  # 1 GB read + 1 GB written in 0.5 s
    # 16 GB of weights + 1 GB of KV at 4 TB/s: 4.25 ms; twice the bytes, twice the floor
    assert gc.bandwidth_floor_s(16 * 10**9, 10**9, 4e12) == pytest.approx(4.25e-3)
    assert gc.bandwidth_floor_s(32 * 10**9, 2 * 10**9, 4e12) == pytest.approx(8.5e-3)


def _sections(step_b1: float, graphs_b1: float | None, verify5: float) -> dict:
    s = {"bandwidth": {"bytes_per_s_best": 4e12},
         "model": {"weight_bytes": {"per_decode_step": 16 * 10**9}, "kv_bytes_per_token": 131072},
         "decode": {"context_tokens": 100, "by_batch": {"1": {"step_ms": step_b1}}},
         "verify_cost": {"engine": {"relative": {"5": verify5}}, "forward": {"relative": {"5": 9.9}}},
         "tests": {"status": "ok", "passed": 3, "failed": 0, "errors": 0, "skipped": 1}}
    if graphs_b1 is not None:
        s["graphs"] = {"by_batch": {"1": {"step_ms": graphs_b1}}}
    return s


def test_summary_goals_are_met_and_missed_by_the_numbers():
    floor_ms = 1e3 * (16e9 + 100 * 131072) / 4e12  # 4.0033 ms
    met = gc.summarize(_sections(step_b1=10.0, graphs_b1=5.0, verify5=1.05))
    assert met["bandwidth_floor_ms"] == pytest.approx(floor_ms, rel=1e-4)
    assert met["decode_b1_step_ms"] == 5.0  # the faster of eager and graphs
    assert met["decode_b1_over_floor"] == pytest.approx(5.0 / floor_ms, rel=1e-3)
    assert met["graphs_over_eager_b1"] == 2.0
    assert met["verify5_over_verify1"] == 1.05  # the engine's number, not the forward's
    assert met["verify5_from"] == "engine"
    with_graphs = _sections(step_b1=10.0, graphs_b1=5.0, verify5=1.05)
    with_graphs["verify_cost"]["engine_graphs"] = {"relative": {"5": 1.02}}
    assert gc.summarize(with_graphs)["verify5_over_verify1"] == 1.02  # as served: with graphs
    assert {g: v["met"] for g, v in met["goals"].items()} == {
        "decode_b1_over_floor": True, "verify5_over_verify1": True, "graphs_over_eager_b1": True}
    assert met["tests"] == {"passed": 3, "failed": 0, "errors": 0, "skipped": 1}
    # the control: slower steps, dearer verification, weaker graphs miss every goal
    missed = gc.summarize(_sections(step_b1=10.0, graphs_b1=6.0, verify5=1.2))
    assert {g: v["met"] for g, v in missed["goals"].items()} == {
        "decode_b1_over_floor": False, "verify5_over_verify1": False, "graphs_over_eager_b1": False}
    # nothing measured: no goal judged, no exception
    empty = gc.summarize({})
    assert all(v["met"] is None for v in empty["goals"].values())


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _runners(clock: FakeClock, cost_s: float, fail: str | None = None) -> dict:
    def make(name):
        def run():
            clock.t += cost_s
            if name == fail:
                raise RuntimeError("boom")
            return {"value": name}
        return run
    return {name: make(name) for name in gc.SECTIONS}


def test_sections_that_no_longer_fit_the_budget_are_skipped_with_the_reason(tmp_path):
    clock = FakeClock()
    opts = gc.Options(device="cpu", tiny=True, budget_s=10.0, out=tmp_path / "b.json")
    result = gc.Check(opts, clock=clock, runners=_runners(clock, 4.0)).run()
    status = {n: s["status"] for n, s in result["sections"].items()}
    # each section is estimated at 2 s on the CPU: three fit (0 -> 4 -> 8 -> 12 s), then none
    assert status == {"env": "ok", "tests": "ok", "bandwidth": "ok", "model": "skipped", "decode": "skipped",
                      "graphs": "skipped", "verify_cost": "skipped", "spec": "skipped", "long_context": "skipped",
                      "profile": "skipped"}
    assert "time budget: -2 s left" in result["sections"]["model"]["reason"]
    assert json.loads((tmp_path / "b.json").read_text())["sections"]["spec"]["status"] == "skipped"
    # the control: with room for all of them, none is skipped
    clock2 = FakeClock()
    roomy = gc.Check(gc.Options(device="cpu", tiny=True, budget_s=100.0, out=tmp_path / "c.json"), clock=clock2,
                     runners=_runners(clock2, 4.0)).run()
    assert {s["status"] for s in roomy["sections"].values()} == {"ok"}


def test_an_error_is_recorded_and_the_run_moves_on(tmp_path):
    clock = FakeClock()
    result = gc.Check(gc.Options(device="cpu", tiny=True, out=tmp_path / "e.json"), clock=clock,
                      runners=_runners(clock, 0.1, fail="bandwidth")).run()
    bw = result["sections"]["bandwidth"]
    assert bw["status"] == "error" and bw["error"] == "RuntimeError: boom"
    assert "Traceback" in bw["traceback"] and "boom" in bw["traceback"]
    assert result["errors"] == ["bandwidth: RuntimeError: boom"]
    after = list(gc.SECTIONS)[list(gc.SECTIONS).index("bandwidth") + 1:]
    assert all(result["sections"][n]["status"] == "ok" for n in after)
    assert json.loads((tmp_path / "e.json").read_text())["errors"] == ["bandwidth: RuntimeError: boom"]


def test_sections_needing_the_model_are_skipped_when_it_failed(tmp_path, monkeypatch):
    def broken(opts, state):
        raise MemoryError("no room")

    monkeypatch.setattr(gc, "model_section", broken)
    opts = gc.Options(device="cpu", tiny=True, out=tmp_path / "m.json", sections=("model", "decode", "spec"))
    result = gc.Check(opts).run()
    s = result["sections"]
    assert s["model"]["status"] == "error" and "MemoryError" in s["model"]["error"]
    assert s["decode"]["status"] == "skipped" and "model section: error" in s["decode"]["reason"]
    assert s["env"]["status"] == "skipped" and "--sections" in s["env"]["reason"]


def test_hard_cap_stops_a_hanging_section():
    with pytest.raises(gc.SectionTimeout):
        with gc.hard_cap(0.2):
            time.sleep(5)
    with gc.hard_cap(5):  # the control: a quick body is left alone, and the alarm is cleared after
        time.sleep(0.01)
    time.sleep(0.05)


def test_run_pytest_counts_and_names_failures(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest, time\n"
        "def test_ok():\n    assert True\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='needs a CUDA device')\n"
        "def test_skipped():\n    pass\n")
    r = gc.run_pytest(["test_sample.py"], 60, cwd=tmp_path)
    assert r["status"] == "ok" and r["timed_out"] is False and r["returncode"] == 1
    assert (r["passed"], r["failed"], r["errors"], r["skipped"]) == (1, 1, 0, 1)
    assert r["failures"][0]["test"].endswith("::test_bad") and "one is not two" in r["failures"][0]["message"]
    assert list(r["skip_reasons"].values()) == [1] and "needs a CUDA device" in list(r["skip_reasons"])[0]


def test_run_pytest_stops_at_its_timeout_and_keeps_what_finished(tmp_path):
    (tmp_path / "test_slow.py").write_text("import time\n"
                                           "def test_quick():\n    pass\n"
                                           "def test_wrong():\n    assert False\n"
                                           "def test_slow():\n    time.sleep(60)\n")
    r = gc.run_pytest(["test_slow.py"], 10, cwd=tmp_path, per_test_timeout_s=600)  # room for a loaded machine
    assert r["timed_out"] is True and r["status"] == "error" and "10 s" in r["error"]
    assert r["counted_from"] == "stream" and r["crashes"] == [] and r["unfinished"] == ["test_slow.py::test_slow"]
    assert (r["passed"], r["failed"]) == (1, 1) and r["failures"][0]["test"] == "test_slow.py::test_wrong"


def test_parse_verbose_counts_each_test_once():
    text = ("tests/a.py::test_x[cpu] PASSED   [ 10%]\ntests/a.py::test_y SKIPPED (needs CUDA)  [ 20%]\n"
            "tests/a.py::test_z PASSED\ntests/a.py::test_z ERROR\nnoise PASSED\n")
    r = gc.parse_verbose(text)
    assert (r["passed"], r["skipped"], r["errors"], r["failed"]) == (1, 1, 1, 0)


def test_the_cuda_subset_and_the_cpu_skip():
    files = gc.cuda_test_files()
    assert "tests/unit/test_cuda_engine.py" in files
    assert "tests/unit/test_kernels.py" in files and "tests/unit/test_triton_attention.py" in files
    r = gc.tests_section(gc.Options(device="cpu", tiny=True), 100, None)
    assert r["status"] == "skipped" and "CUDA-only" in r["reason"]


def test_kernels_shim_maps_the_folder_to_its_import_name(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "adaptspec_kernels" else real(name, *a))
    shim = gc.ensure_kernels_importable()
    try:
        assert shim is not None and sys.path[0] == shim
        linked = gc.Path(shim) / "adaptspec_kernels" / "verify.py"
        assert linked.read_bytes() == (gc.REPO / "kernels" / "verify.py").read_bytes()
    finally:
        sys.path.remove(shim)


def test_options_and_cli_refuse_bad_input_naming_the_field(capsys):
    with pytest.raises(ValueError, match="--device"):
        gc.Options(device="tpu")
    with pytest.raises(ValueError, match="--sections"):
        gc.Options(sections=("decode", "warp"))
    with pytest.raises(ValueError, match="--budget-s"):
        gc.Options(budget_s=0)
    with pytest.raises(SystemExit):
        gc.main(["--device", "cpu", "--batches", "0"])
    assert "--batches" in capsys.readouterr().err


def test_default_output_goes_to_out_when_set(monkeypatch):
    now = gc._dt.datetime(2026, 12, 2, tzinfo=gc._dt.timezone.utc)
    monkeypatch.setenv("OUT", "/tmp/device-out")
    assert str(gc.default_out(gc.Options(), now)) == "/tmp/device-out/gpu-check-2026-12-02.json"
    monkeypatch.delenv("OUT")
    assert gc.default_out(gc.Options(), now) == gc.REPO / "docs/results/gpu-check-2026-12-02.json"
    assert gc.default_out(gc.Options(device="cpu", tiny=True), now).name == "gpu-check-2026-12-02-cpu-tiny.json"


def test_carry_check_passes_and_its_import_blocker_bites():
    ok, lines = gc.carry_check()
    assert ok, lines
    assert any(line.startswith("imports: ok") for line in lines)
    # the control: the same blocker refuses a package the device image lacks
    code = gc.BLOCKER.format(absent=set(gc.ABSENT_ON_DEVICE)) + "import pydantic\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "absent on the device image: pydantic" in r.stderr


def test_random_model_shapes_and_weight_bytes():
    from adaptspec.models.synthetic import TINY, IdTokenizer, random_model, weight_bytes

    m = random_model(TINY, "fp32", "cpu", matmul="reference")
    # per layer: 2 norms (64 each), qkv (64 + 32 + 32 rows x 64), o (64 x 64), gate/up (256 x 64),
    # down (64 x 128) = 36,992 floats; x 2 layers, + output layer 256 x 64 + final norm 64
    per_step = (2 * 36_992 + 256 * 64 + 64) * 4
    assert weight_bytes(m.model) == {"per_decode_step": per_step, "total": per_step + 256 * 64 * 4}
    again = random_model(TINY, "fp32", "cpu", matmul="reference")
    assert torch.equal(m.model.lm_head, again.model.lm_head)  # seeded
    other = random_model(TINY, "fp32", "cpu", matmul="reference", seed=1)
    assert not torch.equal(m.model.lm_head, other.model.lm_head)
    tok = IdTokenizer(8)
    assert tok("t3 t5")["input_ids"] == [3, 5] and tok.decode([3, 5]) == "t3 t5"
    with pytest.raises(ValueError, match="token ids"):
        tok("hello")


def test_run_pytest_survives_a_test_that_kills_the_process(tmp_path):
    """A test that aborts the interpreter (as a CUDA fault does) is named as a crash, the
    tests before it keep their results and messages, and the ones after it still run."""
    (tmp_path / "test_crash.py").write_text(
        "import os\n"
        "def test_a_ok():\n    pass\n"
        "def test_b_bad():\n    assert 1 == 2, 'one is not two'\n"
        "def test_c_abort():\n    os.abort()\n"
        "def test_d_after():\n    pass\n")
    log = tmp_path / "pytest.log"
    r = gc.run_pytest(["test_crash.py"], 120, cwd=tmp_path, log_path=log)
    assert r["counted_from"] == "stream" and r["attempts"] == 2 and r["status"] == "ok"
    assert (r["passed"], r["failed"], r["errors"]) == (2, 1, 1)
    kinds = {f["test"].split("::")[1]: f for f in r["failures"]}
    assert kinds["test_c_abort"]["kind"] == "crash" and r["crashes"][0]["returncode"] < 0
    assert "one is not two" in kinds["test_b_bad"]["message"]
    assert "Extension modules:" not in r["output_tail"] or "(left out)" in r["output_tail"]
    assert "attempt 2" in log.read_text()


def test_run_pytest_without_a_crash_runs_once(tmp_path):
    """The control: the same file without the abort runs in one attempt, no crash named."""
    (tmp_path / "test_fine.py").write_text("def test_a():\n    pass\ndef test_b():\n    pass\n")
    r = gc.run_pytest(["test_fine.py"], 120, cwd=tmp_path)
    assert r["attempts"] == 1 and r["crashes"] == [] and (r["passed"], r["errors"]) == (2, 0)


def test_union_of_busy_intervals():
    from adaptspec.tools.gpu_speed import union_us

    assert union_us([(0, 2), (1, 3), (5, 6)]) == 4  # overlaps count once
    assert union_us([(0, 2), (0.5, 1), (2, 3)]) == 3  # a nested interval adds nothing
    assert union_us([(0, 2), (5, 6)]) == 3 and union_us([]) == 0  # control: disjoint ones add up


def test_the_profile_section_on_the_cpu_names_host_ops_and_no_device_time():
    opts = gc.Options(device="cpu", tiny=True)
    state: dict = {}
    gc.model_section(opts, state)
    r = gc.profile_section(opts, state)
    p = r["modes"]["eager"]
    assert r["errors"] == {} and p["steps"] == 6 and p["wall_ms_per_step"] > 0
    assert p["device_busy_ms_per_step"] is None and p["kernels"] == []  # the CPU has no device events
    assert any(op["name"].startswith("aten::") for op in p["host_ops"])


def test_the_long_context_section_counts_the_kv_it_reads_in_its_floor():
    opts = gc.Options(device="cpu", tiny=True)
    state: dict = {}
    gc.model_section(opts, state)
    bw = 1e11
    r = gc.long_context_section(opts, {**state, "bytes_per_s": bw})
    one = r["by_batch"]["1"]
    assert r["errors"] == {} and r["context_tokens"] == 256 and one["steps"] == opts.decode_steps
    c = state["target"].model.cfg
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * 256  # fp32 keys and values of the context
    from adaptspec.models.synthetic import weight_bytes

    floor = 1e3 * (weight_bytes(state["target"].model)["per_decode_step"] + kv) / bw
    assert one["floor_ms"] == round(floor, 4) and one["over_floor"] == pytest.approx(one["step_ms"] / floor, rel=1e-3)
