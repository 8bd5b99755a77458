"""The EAGLE-3 head pipeline: the ShareGPT reader, stored features, training on them,
the simulated acceptance, the head's file format (new and old)."""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest
import torch

from adaptspec.distill import sharegpt
from adaptspec.distill.features import FeatureStore, Item, Teacher, extract, onpolicy_items
from adaptspec.distill.head import (DraftHead, HeadConfig, build_head, default_feature_layers, load_head_state,
                                    read_head_config, save_head)
from adaptspec.distill.shard_train import ShardTrainConfig, ShardTrainer, collate, evaluate, simulate_acceptance
from tests.conftest import make_tiny_model

V = 40


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    # peaked (large init): greedy continuations a head can learn in a few dozen steps
    return make_tiny_model(tmp_path_factory.mktemp("e3_target"), vocab=V, seed=3, hidden=32, layers=4, init=0.5)


# ---- ShareGPT ---------------------------------------------------------------------------
def test_json_array_stream_stops_at_the_cut():
    text = '[\n {"a": 1},\n {"b": [1, "]"]}, {"c": "trunc'
    assert list(sharegpt.iter_json_array(io.StringIO(text), chunk_chars=5)) == [{"a": 1}, {"b": [1, "]"]}]
    assert list(sharegpt.iter_json_array(io.StringIO("[]"))) == []
    with pytest.raises(ValueError, match="JSON array"):
        list(sharegpt.iter_json_array(io.StringIO('{"a": 1}')))


def test_conversations_are_cleaned(tmp_path):
    rows = [
        {"id": "a_0", "conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"},
                                        {"from": "human", "value": "dangling question"}]},
        {"id": "b_0", "conversations": [{"from": "gpt", "value": "starts with the model"},
                                        {"from": "human", "value": "x"}]},
        {"id": "c_0", "conversations": [{"from": "human", "value": "Привет, как дела?"}, {"from": "gpt", "value": "ok"}]},
        {"id": "d_0", "conversations": [{"from": "human", "value": "one"}, {"from": "gpt", "value": "two"},
                                        {"from": "gpt", "value": "twice in a row"}]},
    ]
    whl = tmp_path / "x.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr(sharegpt.MEMBER, json.dumps(rows)[:-40])  # cut off inside the last object
    convs = list(sharegpt.read_conversations(whl))
    # a: the dangling user turn dropped; b: starts with the model, dropped; c: not English;
    # d: cut off by the truncation
    assert [(c.id, c.turns) for c in convs] == [("a_0", [("user", "Hi there"), ("assistant", "Hello!")])]


def test_held_out_split_is_stable_and_keeps_parts_together():
    ids = [f"conv{i}" for i in range(4000)]
    held = [i for i in ids if sharegpt.is_held_out(i)]
    assert 40 <= len(held) <= 130  # about 2%
    assert all(sharegpt.is_held_out(i + "_0") == sharegpt.is_held_out(i + "_7") for i in ids[:500])


# ---- features ---------------------------------------------------------------------------
def _items(n: int, seed: int, target_dir: Path, length: int = 24, prompt: int = 5) -> list[Item]:
    """Greedy continuations of random prompts by the tiny target (its own answers), all
    rows decoded at once (a full forward per token: the model is tiny)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    ids = torch.randint(0, V, (n, prompt), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for _ in range(length):
            ids = torch.cat([ids, m(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    T = prompt + length
    return [Item(row, [prompt - 1 <= t < T - 1 for t in range(T)], "chat") for row in ids.tolist()]


def test_features_are_hidden_states_and_extraction_resumes(target_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    items = _items(6, 0, target_dir)
    layers = [1, 2, 4]  # 4 = the last: transformers' tuple holds the normed final state there
    store = FeatureStore(tmp_path / "fs", {"feature_layers": layers})
    t = Teacher(target_dir, torch.float32, layers)
    budget = sum(sum(x.loss) for x in items[:3])
    extract(store, t, {"a": iter(items)}, {"a": budget}, shard_tokens=30, batch_tokens=29)  # 1 item a batch
    assert store.consumed("a") == 3 and store.loss_tokens == budget
    again = FeatureStore(tmp_path / "fs", {"feature_layers": layers})  # a later run goes on after item 3
    extract(again, t, {"a": iter(items)}, {"a": 10**9}, shard_tokens=30, batch_tokens=30)
    assert again.consumed("a") == 6 and again.loss_tokens == sum(sum(x.loss) for x in items)
    with pytest.raises(ValueError, match="feature_layers"):
        FeatureStore(tmp_path / "fs", {"feature_layers": [0]})
    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    seqs = [s for i in range(len(again.shards)) for s, _ in again.sequences(i)]
    assert [s["ids"].tolist() for s in seqs] == [x.ids for x in items]
    for s, x in zip(seqs, items):
        with torch.no_grad():
            o = hf(torch.tensor([x.ids]), output_hidden_states=True)
        want = torch.cat([o.hidden_states[i][0] for i in layers], -1)
        torch.testing.assert_close(s["aux"].float(), want, atol=0.05, rtol=0.01)  # stored in bf16
        torch.testing.assert_close(s["final"].float(), o.hidden_states[-1][0], atol=5e-3, rtol=1e-3)
        learn = torch.tensor(x.loss)
        assert torch.equal(s["loss"].bool(), learn)
        torch.testing.assert_close(s["lse"][learn], torch.logsumexp(o.logits[0][learn], -1), atol=1e-4, rtol=1e-4)
        assert torch.equal(s["argmax"][learn].long(), o.logits[0][learn].argmax(-1))
        assert (s["lse"][~learn] == 0).all()


# ---- the simulated acceptance ----------------------------------------------------------------
class _ScriptedHead:
    """Drafts a fixed table: ``table[s][j]`` is what pass s + 1 drafts at entry j."""

    def __init__(self, table: list[list[int]]):
        self.table = table
        self.vocab_ids = torch.arange(V)

    def __call__(self, feats, ids, passes):
        return [torch.tensor(self.table[s], dtype=torch.float32)[None] for s in range(passes)]

    def logits(self, g):
        return torch.nn.functional.one_hot(g.long(), V).float()


def test_simulated_decoding_on_a_hand_built_case():
    # tokens x_0..x_9; the prompt is x_0..x_2 (P = 3): the prefill emits x_3, so the first
    # step has x_0..x_3 committed (m = 4) and its candidate i is pass i at entry m - 3 + i,
    # which drafts x_{m - 1 + i}
    x = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    right = [[x[j + 2] if j + 2 < 10 else 0 for j in range(9)] for _ in range(3)]  # every pass right everywhere
    table = [row[:] for row in right]
    table[1][3] = 0  # pass 2 at entry 3 (the first step's candidate 2, x_5) is wrong
    batch = {"feats": torch.zeros(1, 10, 1), "ids": torch.tensor([x]), "lens": torch.tensor([10])}
    [t] = simulate_acceptance(_ScriptedHead(table), batch, 3, [3])
    # step 1, m = 4: pass 1 entry 2 drafts x_4 right, pass 2 entry 3 wrong: a = 1, emit 2 -> m = 6
    # step 2, m = 6: passes 1-3 at entries 4, 5, 6 right: a = 3, emit 4 -> m = 10 = n: done
    assert (t["steps"], t["emitted"], t["accepted"], t["drafted"], t["judged"]) == (2, 6, 4, 6, 5)
    [t] = simulate_acceptance(_ScriptedHead(right), batch, 3, [3])
    # all right: m = 4 -> 8 (a = 3), then k is capped at n - m - 1 = 1: a = 1, m = 10
    assert (t["steps"], t["emitted"], t["accepted"], t["drafted"]) == (2, 6, 4, 4)


# ---- training ---------------------------------------------------------------------------------
def _tcfg(target_dir):
    from transformers import AutoConfig

    from adaptspec.models.llama import LlamaConfig

    return LlamaConfig.from_hf(AutoConfig.from_pretrained(target_dir))


def test_training_on_stored_features_raises_held_out_acceptance_and_resumes(target_dir, tmp_path):
    from adaptspec.models.loader import load_weights

    layers = default_feature_layers(4)
    t = Teacher(target_dir, torch.float32, layers)
    train, held = FeatureStore(tmp_path / "train"), FeatureStore(tmp_path / "held")
    extract(train, t, {"a": iter(_items(32, 1, target_dir))}, {"a": 10**9}, shard_tokens=300)
    extract(held, t, {"a": iter(_items(8, 1, target_dir))}, {"a": 10**9})  # same prompts: fitting, not generalising
    cfg = ShardTrainConfig(vocab_top=30, passes=2, lr=1e-2, batch_tokens=512, steps=40, warmup_steps=5,
                           eval_every_steps=20, eval_k=3, init="random", autocast=False, buffer_shards=2)
    w = load_weights(target_dir)
    tr = ShardTrainer(cfg, train, held, w, _tcfg(target_dir), tmp_path / "out", feature_layers=layers)
    st = tr.train(progress=False)
    assert st.step == 40 and [p["step"] for p in st.curve] == [0, 20, 40, 40]
    first, last = st.curve[0]["held_out"], st.curve[-1]["held_out"]
    assert last["alpha"] > first["alpha"] + 0.15 and last["acc_len"] > first["acc_len"] + 0.1
    # resume: a longer run continues from step 40 with the optimizer's state
    from dataclasses import replace

    tr2 = ShardTrainer(replace(cfg, steps=46), train, held, w, _tcfg(target_dir), tmp_path / "out",
                       feature_layers=layers)
    st2 = tr2.train(progress=False)
    assert st2.step == 46 and [p["step"] for p in st2.curve][:4] == [0, 20, 40, 40]
    assert {int(v["step"]) for v in tr2.opt.state_dict()["state"].values()} == {46}
    with pytest.raises(ValueError, match="passes"):
        ShardTrainer(replace(cfg, passes=3, steps=50), train, held, w, _tcfg(target_dir), tmp_path / "out",
                     feature_layers=layers).train(progress=False)
    # the saved head reloads into the same drafts (the simulated acceptance is unchanged)
    tr2.use_best()
    folder = save_head(tr2.head, tmp_path / "head", dtype=torch.float32)
    cfg_r = read_head_config(folder)
    assert cfg_r.arch == "eagle3" and cfg_r.feature_layers == layers and cfg_r.format_version == 2
    again = build_head(cfg_r, load_head_state(folder), w, tie=False)
    assert evaluate(again, held, 3) == evaluate(tr2.head, held, 3)


def test_a_saved_first_format_head_continues_on_chosen_sources(target_dir, tmp_path):
    """``init_head``: the trainer starts from a saved format-1 head (its weights, its draft
    vocabulary, the final-state feature), so its first held-out point is that head's own
    acceptance; ``sources`` keeps the other source's shards out of the batches."""
    from dataclasses import replace

    from adaptspec.models.loader import load_weights

    layers = default_feature_layers(4)
    t = Teacher(target_dir, torch.float32, layers)
    train, held = FeatureStore(tmp_path / "train"), FeatureStore(tmp_path / "held")
    extract(train, t, {"a": iter(_items(24, 1, target_dir)), "b": iter(_items(8, 2, target_dir))},
            {"a": 10**9, "b": 10**9}, shard_tokens=300)
    extract(held, t, {"a": iter(_items(8, 1, target_dir))}, {"a": 10**9})
    w, tcfg = load_weights(target_dir), _tcfg(target_dir)
    base = ShardTrainConfig(arch="adaptspec", vocab_top=30, passes=2, lr=1e-2, batch_tokens=512, steps=30,
                            warmup_steps=5, eval_every_steps=0, eval_k=3, init="random", autocast=False,
                            buffer_shards=2, sources=["a"])
    first = ShardTrainer(base, train, held, w, tcfg, tmp_path / "first", feature_layers=layers)
    st = first.train(progress=False)
    assert st.curve[-1]["held_out"]["alpha"] > st.curve[0]["held_out"]["alpha"] + 0.15  # the final-state feature learns
    assert {train.shards[i]["source"] for i in first.shard_ids} == {"a"} and len(first.shard_ids) < len(train.shards)
    folder = save_head(first.head, tmp_path / "head", dtype=torch.float32)
    assert read_head_config(folder).arch == "adaptspec"
    cont = ShardTrainer(replace(base, init_head=str(folder), vocab_top=7, steps=0), train, held, w, tcfg,
                        tmp_path / "cont", feature_layers=layers)
    assert torch.equal(cont.head.vocab_ids, first.head.vocab_ids)  # the head's vocabulary, not vocab_top's
    assert cont.train(progress=False).curve[0]["held_out"] == evaluate(first.head, held, 3, "final")
    with pytest.raises(ValueError, match="init_head"):
        ShardTrainer(replace(base, init_head=str(folder), arch="eagle3"), train, held, w, tcfg, tmp_path / "x",
                     feature_layers=layers)
    with pytest.raises(ValueError, match="sources"):
        ShardTrainer(replace(base, sources=["c"]), train, held, w, tcfg, tmp_path / "y", feature_layers=layers)


# ---- the file format ----------------------------------------------------------------------------
def test_the_first_format_still_reads(tmp_path):
    from adaptspec.models.registry import packaged_dir

    cfg = read_head_config(packaged_dir("smollm2-135m-draft"))
    assert cfg.format_version == 1 and cfg.arch == "adaptspec" and cfg.feature_layers == []


def test_head_config_errors_name_the_field():
    base = dict(hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                rms_norm_eps=1e-6, rope_theta=1e4, max_position=32, target_vocab_size=10, draft_vocab_size=10)
    with pytest.raises(ValueError, match="arch"):
        HeadConfig(**base, arch="medusa")
    with pytest.raises(ValueError, match="feature_layers"):
        HeadConfig(**base, feature_layers=[1, 2])  # the adaptspec layout reads the final state only
    with pytest.raises(ValueError, match="feature_layers"):
        HeadConfig(**base, arch="eagle3", feature_layers=[1, 1])
    with pytest.raises(ValueError, match="exclusive"):
        HeadConfig(**base, arch="eagle3", feature_layers=[1], norm_before_fc=True, fc_norm=True)
    assert default_feature_layers(30) == [2, 15, 27] and default_feature_layers(4) == [1, 2]
