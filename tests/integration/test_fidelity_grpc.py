"""``adaptspec fidelity --grpc``: the levels run through Ray Serve and gRPC as well as in-process,
and both paths are compared with the same simulated runs (tiny models: the plumbing, not the
fidelity)."""
from __future__ import annotations

import json

import pytest
import yaml

pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(300)

GRPC_PORT, HTTP_PORT = 9333, 8333


def test_fidelity_runs_both_paths_and_the_grpc_rows_carry_cached_tokens(tiny_dir, tiny_draft_dir, tmp_path):
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
                                   "--calibrate-repeats", "1", "--grpc"])
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
