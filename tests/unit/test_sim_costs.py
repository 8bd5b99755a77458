"""Cost profiles: the file format, the built-in GPU numbers and their fit from ../shared."""
import json
from pathlib import Path

import numpy as np
import pytest

from adaptspec.control import gpu_profiles as gpu
from adaptspec.control.costs import ProfileCostModel, ProfileFile

SHARED = Path(__file__).resolve().parents[3] / "shared"


def test_profile_file_round_trip_and_errors(tmp_path):
    m = gpu.builtin_profile("h100-8b-1b")
    p = tmp_path / "p.json"
    m.save(p)
    again = ProfileCostModel.load(p)
    assert again.profile == m.profile
    data = json.loads(p.read_text())
    data["verify_s"] = data["verify_s"][:-1]
    p.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="verify_s"):
        ProfileCostModel.load(p)
    data = json.loads(m.profile.model_dump_json())
    data["draft_batch"] = [4.0, 2.0, 8.0, 16.0, 32.0, 64.0, 96.0, 128.0, 256.0]
    with pytest.raises(ValueError, match="ascending"):
        ProfileFile.model_validate(data)


def test_step_time_parts():
    prof = ProfileFile(name="toy", verify_tokens=[1, 101], verify_s=[0.01, 0.02], verify_context_s_per_token=1e-6,
                       draft_batch=[1, 11], draft_s=[0.001, 0.002], ngram_s_per_request=1e-4, step_overhead_s=0.003)
    m = ProfileCostModel(prof)
    # 51 tokens -> 0.015 s verify + 1000 context tokens x 1 us; draft at positions with 1 and 11 requests
    t = m.step(51, 1000, np.array([11.0, 1.0, 0.0]), 2, 0.0)
    assert t.verify_s == pytest.approx(0.016)
    assert t.draft_s == pytest.approx(0.002 + 0.001 + 2e-4)
    assert t.other_s == 0.003
    assert m.verify_s(201, 0) == pytest.approx(0.03)  # extrapolates on the last slope


def test_prompt_tokens_are_priced_on_the_prompt_table_when_the_profile_has_one():
    """Prompt table P: 0 -> 0.012 s (empty step: the verify table's 1-token price), 8 -> 0.013 s
    (the first rows ride on reading the weights), 16 -> 0.03 s, 64 -> 0.09 s. A prompt-only step
    of 32 tokens costs the table's 0.05 s; a step with 8 decode tokens and 32 prompt tokens costs
    verify(8) + P(40) - P(8): the prompt rows come on top of the decode rows, past the nearly free
    first ones (priced from an empty pass, P(32) - P(0), they would cost 0.009 s less); without a
    prompt table (the control) the same step costs verify(40), as it always did."""
    kw = dict(name="t", verify_tokens=[1, 101], verify_s=[0.012, 0.112], step_overhead_s=0.001)
    m = ProfileCostModel(ProfileFile(**kw, prefill_tokens=[8, 16, 64], prefill_s=[0.013, 0.03, 0.09]))
    plain = ProfileCostModel(ProfileFile(**kw))
    none = np.zeros(1)
    assert m.step(32, 0, none, 0, 0.0, prompt_tokens=32).verify_s == pytest.approx(0.05)
    mixed = m.step(40, 0, none, 0, 0.0, prompt_tokens=32).verify_s
    assert mixed == pytest.approx(0.019 + 0.06 - 0.013)
    assert mixed - (0.019 + 0.05 - 0.012) == pytest.approx(0.009)  # what an empty pass's marginal would miss
    assert m.prompt_s(32, 8) == pytest.approx(0.06 - 0.013) and m.prompt_s(32) == pytest.approx(0.05 - 0.012)
    assert m.step(8, 0, none, 0, 0.0, prompt_tokens=8).verify_s == pytest.approx(0.013)
    assert m.step(8, 0, none, 0, 0.0).verify_s == plain.step(8, 0, none, 0, 0.0).verify_s  # no prompt: as before
    assert m.step(128, 0, none, 0, 0.0, prompt_tokens=128).verify_s == pytest.approx(0.17)  # extrapolates
    assert plain.step(40, 0, none, 0, 0.0, prompt_tokens=32).verify_s == pytest.approx(0.051)  # the control
    with pytest.raises(ValueError, match="prefill"):
        ProfileFile(**kw, prefill_tokens=[16, 64], prefill_s=[0.03])


@pytest.mark.parametrize("name", gpu.BUILTIN)
def test_builtin_profiles_are_sane(name):
    m = gpu.builtin_profile(name)
    v = np.asarray(m.profile.verify_s)
    assert np.all(np.diff(v) >= 0)  # more tokens never cost less
    c = m.profile.draft_s[0] / (v[0] + m.profile.step_overhead_s)  # cost ratio at batch 1
    assert 0.03 < c < 0.3


def test_h200_is_faster_where_memory_bound_and_70b_slower_than_8b():
    h100, h200 = gpu.builtin_profile("h100-8b-1b"), gpu.builtin_profile("h200-8b-1b")
    assert h200.verify_s(1, 0) < 0.8 * h100.verify_s(1, 0)
    assert h200.verify_s(4096, 0) > 0.9 * h100.verify_s(4096, 0)  # compute-bound: same chip
    assert gpu.builtin_profile("h100-70b-tp4-1b").verify_s(1, 0) > 2 * h100.verify_s(1, 0)


@pytest.mark.skipif(not (SHARED / "data" / "profiles").exists(),
                    reason="../shared/data/profiles is absent: cannot refit the shipped GPU coefficients")
def test_shipped_coefficients_match_a_refit_of_the_measured_profiles():
    from adaptspec.sim.fit_profiles import KNOTS, fit

    assert tuple(KNOTS) == tuple(gpu.KNOTS)
    fitted = fit(SHARED / "data" / "profiles")
    for key, (layer, up) in fitted.items():
        assert np.allclose(layer, gpu.LAYER_MS[key][0], rtol=1e-6), key
        assert np.allclose(up, gpu.LAYER_MS[key][1], rtol=1e-6), key
