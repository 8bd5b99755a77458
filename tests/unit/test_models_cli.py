"""Model specs and the CLI surface of the engine area."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from adaptspec.cli import app
from adaptspec.models.registry import HubUnreachableError, resolve
from tests.conftest import first_fresh_word

runner = CliRunner()


def test_hub_id_fails_with_one_clear_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnreachableError, match="hub is unreachable.*local folder"):
        resolve("HuggingFaceTB/SmolLM2-360M-Instruct")
    res = runner.invoke(app, ["complete", "hi", "--target", "HuggingFaceTB/SmolLM2-360M-Instruct"])
    assert res.exit_code == 2
    lines = [ln for ln in res.output.strip().splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("error: model 'HuggingFaceTB/SmolLM2-360M-Instruct'")
    assert "Traceback" not in res.output


def test_unknown_specs_are_named(tmp_path):
    with pytest.raises(ValueError, match="not a built-in alias"):
        resolve("no-such-model")
    with pytest.raises(ValueError, match="no config.json"):
        resolve(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve(str(tmp_path / "weights.bin"))


def test_complete_json_on_a_local_folder(tiny_dir):
    res = runner.invoke(app, ["complete", "t1 t2 t3 t1 t2", "--target", str(tiny_dir), "--raw", "--drafter", "ngram",
                              "--k", "3", "--max-new-tokens", "12", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert set(out) == {"text", "token_ids", "stats"} and len(out["token_ids"]) == 12
    assert out["stats"]["steps"] == 11 - out["stats"]["accepted"]  # 11 tokens after the prefill's first


def test_complete_stops_at_a_stop_string(tiny_dir):
    args = ["complete", "t1 t2 t3 t1 t2", "--target", str(tiny_dir), "--raw", "--drafter", "ngram", "--k", "3",
            "--max-new-tokens", "12", "--json"]
    full = json.loads(runner.invoke(app, args).output.strip().splitlines()[-1])["text"]
    words = full.split(" ")
    at = first_fresh_word(full)
    res = runner.invoke(app, args + ["--stop", words[at], "--stop", "never there"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["text"] == full[:full.find(words[at])] and len(out["token_ids"]) == at + 1  # up to the stop token


def test_complete_rejects_bad_k(tiny_dir):
    res = runner.invoke(app, ["complete", "t1", "--target", str(tiny_dir), "--raw", "--k", "17"])
    assert res.exit_code == 2 and "k must be" in res.output


def test_models_list_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPTSPEC_HOME", str(tmp_path))
    res = runner.invoke(app, ["models", "list"])
    assert res.exit_code == 0 and "smollm2-135m" in res.output


def test_tables_in_a_log_are_not_cut_to_80_columns(monkeypatch):
    """Output that is not a terminal (CliRunner captures it, like a log) gets 140 columns unless
    COLUMNS says otherwise: `models list` prints its descriptions whole."""
    from adaptspec.clierr import console

    monkeypatch.delenv("COLUMNS", raising=False)
    assert console().width == 140
    res = runner.invoke(app, ["models", "list"])
    assert res.exit_code == 0 and max(len(ln) for ln in res.output.splitlines()) > 80
    monkeypatch.setenv("COLUMNS", "60")
    assert console().width == 60
