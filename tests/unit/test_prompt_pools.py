"""``--prompts`` of loadtest and fidelity: where the requests' prompts come from."""
from __future__ import annotations

import json

import pytest

from adaptspec.serve.loadtest import LoadSpec, bench_prompts, load_prompts, pick_prompt

CLASSES = ["chat", "code_edit", "extraction"]


def test_no_source_is_the_bench_prompts_and_a_file_gives_its_pools_in_order(tmp_path):
    assert load_prompts(None, CLASSES) is None and LoadSpec(CLASSES).pools() == bench_prompts()
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"chat": ["a", "b", "c"], "code_edit": ["d"], "extraction": ["e", "f"], "other": []}))
    pools = load_prompts(str(f), CLASSES)
    assert pools == {"chat": ["a", "b", "c"], "code_edit": ["d"], "extraction": ["e", "f"]}  # unused classes dropped
    spec = LoadSpec(CLASSES, prompts=pools)
    # classes in turn, each class's prompts in turn (as the simulator's round robin)
    assert [pick_prompt(spec.pools(), CLASSES, n)[::2] for n in range(6)] == [
        ("chat", "a"), ("code_edit", "d"), ("extraction", "e"), ("chat", "b"), ("code_edit", "d"), ("extraction", "f")]


@pytest.mark.parametrize("content, words", [
    ('{"chat": []}', "'chat' needs a non-empty list"),
    ('{"chat": ["ok", ""]}', "'chat' needs a non-empty list"),
    ('{"chat": "one prompt"}', "'chat' needs a non-empty list"),
    ('{"code_edit": ["x"]}', "'chat' needs a non-empty list of non-empty prompt strings (it is missing)"),
    ('["chat"]', "must hold a JSON object"),
    ('{"chat": ', "is not JSON"),
])
def test_a_bad_prompt_file_is_named_with_what_is_wrong(tmp_path, content, words):
    f = tmp_path / "p.json"
    f.write_text(content)
    with pytest.raises(ValueError, match="--prompts") as err:
        load_prompts(str(f), ["chat"])
    assert words in str(err.value)
    with pytest.raises(ValueError, match="--prompts: cannot read"):
        load_prompts(str(tmp_path / "missing.json"), ["chat"])


@pytest.mark.parametrize("source", ["corpus:0", "corpus:", "corpus:x", "corpus:2:-1", "corpus:2:0:1"])
def test_a_bad_corpus_source_is_refused_before_the_corpus_is_built(source):
    with pytest.raises(ValueError, match=r"--prompts: corpus:N or corpus:N:SEED"):
        load_prompts(source, CLASSES)
    with pytest.raises(ValueError, match="the corpus has the classes chat, code_edit, extraction, not default"):
        load_prompts("corpus:2", ["chat", "default"])


def test_corpus_prompts_are_held_out_and_none_is_a_bench_prompt():
    from adaptspec.distill.corpus import build_corpus

    pools = load_prompts("corpus:5", CLASSES)
    held = build_corpus(0).held_out
    bench = {p for ps in bench_prompts().values() for p in ps}
    for c in CLASSES:
        assert len(pools[c]) == 5 == len(set(pools[c])) and set(pools[c]) <= set(held[c])
        assert not set(pools[c]) & bench


def test_loadtest_names_a_bad_prompts_option_before_loading_anything(tmp_path):
    from typer.testing import CliRunner

    from adaptspec.cli import app

    res = CliRunner().invoke(app, ["loadtest", "--in-process", "--prompts", str(tmp_path / "none.json")])
    assert res.exit_code == 2 and "--prompts: cannot read" in res.output
    res = CliRunner().invoke(app, ["fidelity", "--prompts", "corpus:1", "--classes", "chat,default",
                                   "--out", str(tmp_path / "f")])
    assert res.exit_code == 2 and "--prompts: the corpus has the classes" in res.output
    assert not (tmp_path / "f").exists()
