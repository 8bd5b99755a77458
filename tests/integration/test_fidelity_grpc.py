"""``adaptspec fidelity --grpc``: the levels run through Ray Serve and gRPC as well as in-process,
each path compared with simulated runs at its own runs' speed, read off the engine steps its
replica logged (tiny models: the plumbing, not the fidelity)."""
from __future__ import annotations

import json

import pytest
import yaml

pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(300)

GRPC_PORT, HTTP_PORT = 9333, 8333


def test_fidelity_runs_both_paths_the_grpc_rows_carry_cached_tokens_and_its_replica_logs_steps(tiny_dir, tiny_draft_dir, tmp_path):
    from typer.testing import CliRunner

    from adaptspec.cli import app

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "models": {"target": str(tiny_dir), "draft": str(tiny_draft_dir)}, "grpc_port": GRPC_PORT,
        "http_port": HTTP_PORT, "target": {"num_cpus": 0}, "controller": {"report_interval_s": 0.05, "max_k": 4},
        "engine": {"max_num_seqs": 4, "max_model_len": 512, "torch_threads": 1}}))
    out = tmp_path / "fid"
    res = CliRunner().invoke(app, ["fidelity", "--config", str(cfg), "--out", str(out), "--concurrency", "2",
                                   "--duration", "1.5", "--warmup", "0.3", "--max-tokens", "6",
                                   "--policies", "static:ngram:2", "--calibrate-batch", "1,2", "--calibrate-ks", "2",
                                   "--calibrate-repeats", "1", "--grpc", "--speed-from", "steps"])
    assert res.exit_code == 0, res.output
    cells = json.loads((out / "fidelity.json").read_text())["cells"]
    assert {c["path"] for c in cells} == {"in-process", "grpc"}
    grpc = [c for c in cells if c["path"] == "grpc"]
    assert len(grpc) == 4 and all(c["live"]["throughput"] > 0 and c["sim"]["throughput"] > 0 for c in grpc)
    assert all(c["live"]["top_arm"] == "ngram:2" for c in grpc if c["request_class"] != "all")
    # the gRPC responses' usage says what the prefix cache served: a prompt sent again is served
    # its full blocks (the pools are 8 prompts a class, so a run of this length repeats them)
    rows = json.loads((out / "live_runs.json").read_text())["live"]["grpc"][0]["rows"]
    seen, again = set(), []
    paths = []
    for cls, start, first, end, tokens, cut, error, in_window, idx, arms, cached, path in sorted(rows, key=lambda r: r[1]):
        if (cls, idx) in seen and not error:
            again.append(cached)
        seen.add((cls, idx))
        if end is not None and not error:
            paths.append((path, first - start))
    assert again and max(again) >= 16, again
    # and the engine's own TTFT (the last chunk's timings): every finished request's time outside
    # the engine, whose median per level is added to the gRPC path's simulated tokens
    assert paths and all(p is not None and p >= 0 for p, _ in paths), paths
    assert all(p <= ttft + 1e-9 for p, ttft in paths), paths
    delays = json.loads((out / "fidelity.json").read_text())["meta"]["path_delay_s"]
    assert set(delays) == {"grpc"} and list(delays["grpc"]) == ["static:ngram:2 c=2"]

    # the replica's engine steps, fetched by a Serve handle after each run, line up with the
    # client's window on the host's one clock: steps end all through the window (2 clients
    # keep the engine busy), so the gRPC path is priced on its own steps and simulated on its own
    data = json.loads((out / "live_runs.json").read_text())["live"]
    for path in ("in-process", "grpc"):
        run = data[path][0]
        w0, w1 = run["window"]
        ends = [sh[0] for sh in run["shapes"]]
        assert run["steps"] > 10 and len(ends) == run["steps"], (path, run["steps"], len(ends))
        assert all(w0 <= e <= w1 for e in ends)
        assert ends[0] - w0 < 0.5 and w1 - ends[-1] < 0.5, (path, w0, ends[0], ends[-1], w1)
    meta = json.loads((out / "fidelity.json").read_text())["meta"]
    assert meta["paths"]["grpc"]["simulated_as"] == "grpc"
    assert meta["paths"]["grpc"]["speed"]["applied"] and meta["paths"]["grpc"]["speed"]["source"] == "steps"
    assert meta["host_gap_by_path"]["grpc"]["*"]["gaps"] > 0
    # resimulated from the folder: each path on its own host gaps (the gRPC path's engine loop is
    # another process's), so the two paths' simulated runs differ (a control: they are not one)
    from rich.console import Console

    from adaptspec.sim.fidelity_run import resimulate

    _, _, again = resimulate(out, tmp_path / "again", Console(quiet=True), config=str(cfg), speed_from="steps")
    for path in ("in-process", "grpc"):
        fit = meta["host_gap_by_path"][path]["static:ngram:2"]
        assert again["paths"][path]["host_gap"]["static:ngram:2"]["a_s"] == pytest.approx(fit["a_s"])
    assert again["paths"]["grpc"]["host_gap"] != again["paths"]["in-process"]["host_gap"]
    cells = json.loads((tmp_path / "again" / "fidelity.json").read_text())["cells"]
    sim = {(c["path"], c["request_class"]): c["sim"]["tpot_p50"] for c in cells}
    assert sim[("grpc", "all")] != sim[("in-process", "all")]

    # the engine's TTFT counts from the request's posting to the engine loop, so the path delay
    # is the path alone, and the gRPC closed loop's clients pay it between requests; a run on
    # file from before (no engine_ttft_from) is simulated as then (control: fewer requests sent
    # through the round trip than without it)
    assert meta["engine_ttft_from"] == "posted"
    assert any("path there and back" in n for n in again["notes"])
    sent = {(c["path"], c["request_class"]): c["sim"]["requests"] for c in cells}
    data = json.loads((out / "fidelity.json").read_text())
    del data["meta"]["engine_ttft_from"]
    (out / "fidelity.json").write_text(json.dumps(data))
    _, _, before = resimulate(out, tmp_path / "before", Console(quiet=True), config=str(cfg), speed_from="steps")
    assert not any("path there and back" in n for n in before["notes"])
    cells = json.loads((tmp_path / "before" / "fidelity.json").read_text())["cells"]
    unpaid = {(c["path"], c["request_class"]): c["sim"]["requests"] for c in cells}[("grpc", "all")]
    assert unpaid > sent[("grpc", "all")], (unpaid, sent)
