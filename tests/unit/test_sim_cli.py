"""`adaptspec simulate` end to end on a tiny scenario (the sim area's own typer app)."""
import gzip
import json

import typer
from typer.testing import CliRunner

from adaptspec.sim.cli import register
from adaptspec.sim.report import read_json_file

SCENARIO = """
name: tiny
duration_s: 20
warmup_s: 2
drain_s: 20
hardware: {profile: cpu-smollm2-135m-bf16}
classes:
  - name: chat
    prompt_tokens: {dist: fixed, value: 64}
    output_tokens: {dist: fixed, value: 32}
    acceptance: {draft: {bernoulli: 0.4}, ngram: {bernoulli: 0.3}}
workload: {rate: {kind: constant, rps: 0.5}}
sweep: {rps: [0.2, 0.5]}
policies:
  - {kind: thompson}
  - {kind: static, drafter: none, k: 0}
"""


def app():
    a = typer.Typer()
    register(a)
    return a


def test_simulate_writes_json_and_plots(tmp_path):
    s = tmp_path / "tiny.yaml"
    s.write_text(SCENARIO)
    res = CliRunner().invoke(app(), ["simulate", str(s), "--json", str(tmp_path / "r.json"),
                                     "--plot", str(tmp_path / "fig"), "--seed", "3"])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert {r["policy"] for r in data["runs"]} == {"thompson", "static-none"}
    assert len(data["runs"]) == 4
    assert sorted(p.name for p in (tmp_path / "fig").iterdir()) == [
        "tiny-goodput.png", "tiny-k-over-time.png", "tiny-latency-cdf.png"]
    assert "decisions" in res.output
    # a name ending in .gz: the same runs, gzipped (how the shipped scenarios' results are kept)
    res = CliRunner().invoke(app(), ["simulate", str(s), "--json", str(tmp_path / "r.json.gz"), "--seed", "3"])
    assert res.exit_code == 0, res.output
    raw = (tmp_path / "r.json.gz").read_bytes()
    packed = json.loads(gzip.decompress(raw))
    assert raw[:2] == b"\x1f\x8b" and read_json_file(tmp_path / "r.json.gz") == packed
    simulated = lambda d: [(r["policy"], r["rate_rps"], r["output_token_throughput"]) for r in d["runs"]]  # noqa: E731
    assert simulated(packed) == simulated(data)  # the same seed: the same runs (wall times aside)


def test_simulate_reports_a_bad_scenario_by_key(tmp_path):
    s = tmp_path / "bad.yaml"
    s.write_text(SCENARIO.replace("rps: 0.5}", "rps: -1}"))
    res = CliRunner().invoke(app(), ["simulate", str(s)])
    assert res.exit_code == 2
    assert "workload.rate.constant.rps" in res.output
