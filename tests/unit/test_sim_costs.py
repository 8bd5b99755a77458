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
