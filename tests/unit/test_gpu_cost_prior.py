"""The controller's cost prior on CUDA: built-in H100/H200 profiles matched to a model's
shapes (control.gpu_profiles.match_gpu_profile) and the service's ``auto`` selection
(serve.policies.load_cost_prior), with fake device names and shapes."""
from __future__ import annotations

import json
import logging
import subprocess

import numpy as np
import pytest

from adaptspec.control import gpu_profiles as gp
from adaptspec.serve import policies

LLAMA31_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False}
QWEN25_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}


def _close(a, b, rel):
    return np.allclose(np.asarray(a), np.asarray(b), rtol=rel, atol=0)


@pytest.mark.parametrize("name,gpu", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                      ("NVIDIA H100 PCIe", "h100"), ("NVIDIA GH200 480GB", "h200"),
                                      ("NVIDIA A100-SXM4-80GB", None), ("NVIDIA H800", None), ("cpu", None)])
def test_gpu_kind_from_device_names(name, gpu):
    assert gp.gpu_kind(name) == gpu


@pytest.mark.parametrize("device,gpu", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100")])
def test_llama31_8b_shapes_match_the_built_in_8b_profile(device, gpu):
    """The docstring's assumptions applied to Llama-3.1-8B's shapes reproduce the built-in
    8B + 1B profile (which rounded its ratios: 1.0776, 5.83, 8.0B parameters)."""
    m = gp.match_gpu_profile(device, gp.ModelShape.from_config(LLAMA31_8B), gp.BUILTIN_SHAPES["1b"])
    assert (m.gpu, m.source, m.nearest_builtin) == (gpu, "llama2-7b-tp1", f"{gpu}-8b-1b")
    assert m.scale == pytest.approx(218.1 / 202.4, rel=1e-3)  # linear parameters per layer, 8B / Llama-2-7B
    ref = gp.gpu_profile(f"{gpu}-8b-1b")
    assert _close(m.profile.verify_s, ref.verify_s, 2e-3) and _close(m.profile.draft_s, ref.draft_s, 2e-3)
    assert m.profile.verify_context_s_per_token == ref.verify_context_s_per_token
    assert m.profile.kv_capacity_tokens == pytest.approx(ref.kv_capacity_tokens, rel=0.01)
    assert f"x {m.scale:.3f}" in m.describe() and gpu.upper() in m.describe()


def test_70b_at_tp4_matches_its_built_in_profile():
    target = gp.ModelShape(8192, 80, 64, 8, 28672, 128256, tp=4)
    draft = gp.ModelShape(4096, 32, 32, 8, 14336, 128256, tp=4)
    m = gp.match_gpu_profile("NVIDIA H100 80GB HBM3", target, draft)
    assert (m.source, m.scale, m.nearest_builtin) == ("llama2-70b-tp4", 1.0, "h100-70b-tp4-8b-tp4")
    ref = gp.gpu_profile("h100-70b-tp4-8b-tp4")
    assert _close(m.profile.verify_s, ref.verify_s, 2e-3) and _close(m.profile.draft_s, ref.draft_s, 2e-3)


def test_the_profile_follows_the_shapes():
    """A model with twice the MLP is priced dearer than the 8B at every token count, and an H200
    is cheaper than an H100 for the same model (bandwidth-bound small batches)."""
    base = gp.ModelShape.from_config(LLAMA31_8B)
    wide = gp.ModelShape.from_config({**LLAMA31_8B, "intermediate_size": 2 * 14336})
    a, b = (gp.match_gpu_profile("NVIDIA H100 80GB HBM3", s) for s in (base, wide))
    assert b.scale > 1.7 * a.scale and b.source == a.source
    assert all(x > y for x, y in zip(b.profile.verify_s, a.profile.verify_s))
    h200 = gp.match_gpu_profile("NVIDIA H200", base)
    assert h200.profile.verify_s[0] < a.profile.verify_s[0]


@pytest.mark.parametrize("device,shape,reason", [
    ("NVIDIA A100-SXM4-80GB", LLAMA31_8B, "not an H100 or H200"),
    ("NVIDIA H100 80GB HBM3", QWEN25_05B, "0.19x the nearest measured layers"),
])
def test_no_match_says_why(device, shape, reason):
    with pytest.raises(gp.ProfileMismatch, match=reason):
        gp.match_gpu_profile(device, gp.ModelShape.from_config(shape))


def test_no_match_for_fp32_weights_or_unmeasured_tensor_parallelism():
    with pytest.raises(gp.ProfileMismatch, match="2-byte weights"):
        gp.match_gpu_profile("NVIDIA H200", gp.ModelShape.from_config(LLAMA31_8B, dtype="float32"))
    with pytest.raises(gp.ProfileMismatch, match="tensor parallelism 2"):
        gp.match_gpu_profile("NVIDIA H200", gp.ModelShape.from_config(LLAMA31_8B, tp=2))
    with pytest.raises(gp.ProfileMismatch, match="intermediate_size"):
        gp.ModelShape.from_config({k: v for k, v in LLAMA31_8B.items() if k != "intermediate_size"})


def test_a_draft_that_does_not_fit_falls_back_to_the_1b_draft():
    m = gp.match_gpu_profile("NVIDIA H200", gp.ModelShape.from_config(LLAMA31_8B),
                             gp.ModelShape.from_config(QWEN25_05B))
    assert "built-in 1B draft" in m.draft and "do not fit" in m.draft
    assert _close(m.profile.draft_s, gp.gpu_profile("h200-8b-1b").draft_s, 1e-9)


# ---- the service's selection ---------------------------------------------------------------

@pytest.fixture
def model_dir(tmp_path):
    def make(cfg: dict, name: str = "m"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", **cfg}))
        return str(folder)
    return make


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.delenv("ADAPTSPEC_GPU_NAME", raising=False)
    monkeypatch.setattr(policies, "visible_gpu_name", lambda device: None)


def test_auto_on_cuda_seeds_from_the_matched_profile_and_logs_it(model_dir, no_gpu, monkeypatch, caplog):
    target = model_dir(LLAMA31_8B)
    monkeypatch.setattr(policies, "visible_gpu_name", lambda device: "NVIDIA H200")
    with caplog.at_level(logging.INFO, logger="adaptspec.serve.policies"):
        prior = policies.load_cost_prior("auto", target=target, dtype="auto", device="cuda")
    assert prior is not None and prior.profile.name.startswith("H200 8.0B-shaped target")
    assert _close(prior.profile.verify_s, gp.gpu_profile("h200-8b-1b").verify_s, 2e-3)
    assert "matched H200: target layers from llama2-7b-tp1 x 1.078" in caplog.text and "nvidia-smi" in caplog.text


def test_the_gpu_can_be_named_by_env_or_by_the_profile(model_dir, no_gpu, monkeypatch, caplog):
    target = model_dir(LLAMA31_8B)
    monkeypatch.setenv("ADAPTSPEC_GPU_NAME", "NVIDIA H100 80GB HBM3")
    with caplog.at_level(logging.INFO, logger="adaptspec.serve.policies"):
        by_env = policies.load_cost_prior("auto", target=target, dtype="bfloat16", device="cuda:0")
    assert by_env.profile.name.startswith("H100") and "ADAPTSPEC_GPU_NAME" in caplog.text
    # auto:<gpu> wins over the environment, and works where the controller runs on a CPU node
    named = policies.load_cost_prior("auto:h200", target=target, dtype="bfloat16", device="cpu")
    assert named.profile.name.startswith("H200")


def test_no_prior_and_a_clear_warning_when_nothing_matches(model_dir, no_gpu, monkeypatch, caplog):
    small = model_dir(QWEN25_05B, "small")
    big = model_dir(LLAMA31_8B, "big")
    with caplog.at_level(logging.WARNING, logger="adaptspec.serve.policies"):
        assert policies.load_cost_prior("auto", target=big, dtype="bfloat16", device="cuda") is None
        assert "no GPU visible to the controller" in caplog.text and "auto:h100" in caplog.text
        caplog.clear()
        monkeypatch.setattr(policies, "visible_gpu_name", lambda device: "NVIDIA H100 80GB HBM3")
        assert policies.load_cost_prior("auto", target=small, dtype="bfloat16", device="cuda") is None
        assert "no built-in GPU profile matches" in caplog.text and "0.19x" in caplog.text
        assert "adaptspec calibrate" in caplog.text
        caplog.clear()
        assert policies.load_cost_prior("auto", target=str(model_dir({}, "empty")) + "-missing", dtype="bfloat16",
                                        device="cuda") is None
        assert "no config.json on this machine" in caplog.text
    # the CPU default is untouched: no GPU lookup for a model that is not the measured one
    assert policies.load_cost_prior("auto", target=big, dtype="float32", device="cpu") is None


def test_a_draft_model_folder_prices_the_draft(model_dir, no_gpu):
    target = model_dir(LLAMA31_8B, "t")
    draft = model_dir({**LLAMA31_8B, "hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192,
                       "head_dim": 64, "tie_word_embeddings": True}, "d")
    with_draft = policies.load_cost_prior("auto:h200", target=target, dtype="bfloat16", device="cuda", draft=draft)
    assert "phi2-tp1 x 0.773" in with_draft.profile.name


def test_visible_gpu_name_reads_nvidia_smi_by_index(monkeypatch):
    def fake_run(cmd, **kw):
        assert cmd[0] == "nvidia-smi"
        return subprocess.CompletedProcess(cmd, 0, stdout="NVIDIA H100 80GB HBM3\nNVIDIA H200\n", stderr="")

    monkeypatch.setattr(policies.subprocess, "run", fake_run)
    assert policies.visible_gpu_name("cuda") == "NVIDIA H100 80GB HBM3"
    assert policies.visible_gpu_name("cuda:1") == "NVIDIA H200"
    assert policies.visible_gpu_name("cuda:2") is None

    def missing(cmd, **kw):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(policies.subprocess, "run", missing)
    assert policies.visible_gpu_name("cuda") is None
