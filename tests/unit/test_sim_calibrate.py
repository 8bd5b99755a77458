"""The calibration fit recovers a known cost model from (synthetic) measured steps."""
import numpy as np
import pytest

from adaptspec.sim.calibrate import StepSample, fit_profile
from adaptspec.control.costs import ProfileCostModel


def test_fit_profile_recovers_verify_context_draft_and_overhead():
    rng = np.random.default_rng(0)
    samples = []
    for b in (1, 2, 4, 8):
        for drafter, k in (("none", 0), ("ngram", 2), ("draft", 2), ("draft", 4)):
            for _ in range(3):
                tokens = b * (k + 1)
                ctx = int(b * rng.integers(100, 400))
                verify = 0.03 + 0.002 * tokens + 1e-6 * ctx  # the truth
                draft = {"none": 0.0, "ngram": 2e-4 * b, "draft": k * (0.004 + 0.0005 * b)}[drafter]
                samples.append(StepSample(b, drafter, k, tokens, ctx, verify, draft, 0.002))
    prof = fit_profile(samples, name="synthetic", max_num_seqs=8, kv_capacity_tokens=10_000, max_batched_tokens=512)
    m = ProfileCostModel(prof)
    assert prof.calibrated
    assert prof.verify_context_s_per_token == pytest.approx(1e-6, rel=1e-3)
    for tokens in (1, 6, 40):
        assert m.verify_s(tokens, 0) == pytest.approx(0.03 + 0.002 * tokens, rel=1e-3)
    assert prof.draft_batch == [1.0, 2.0, 4.0, 8.0]
    assert prof.draft_s == pytest.approx([0.004 + 0.0005 * b for b in (1, 2, 4, 8)])
    assert prof.ngram_s_per_request == pytest.approx(2e-4)
    assert prof.step_overhead_s == pytest.approx(0.002)


def test_points_measured_at_two_contexts_price_the_context_and_keep_the_per_request_cost_with_a_control():
    """The truth: 0.02 s + 1 ms per token + 2 ms per request + 6 us per context token. Every
    point (batch, k) measured at 32 and at 160 prompt tokens a request: the fit finds the 6 us
    and its table keeps the per-request cost, which grows with the context too (a fit across
    points could hand it to the context). Control: each point at one context (the context grows
    with the batch, as with one prompt length) prices no context."""
    def steps(lengths):
        out = []
        for b in (1, 4, 16):  # one batch size per token count: the table can hold the truth
            for k in (0, 1):
                for i, plen in enumerate(lengths):
                    for step in range(3):
                        ctx = b * (plen + step)
                        t = 0.02 + 0.001 * b * (k + 1) + 0.002 * b + 6e-6 * ctx
                        out.append(StepSample(b, "ngram" if k else "none", k, b * (k + 1), ctx, t, 0.0, 0.001))
        return out

    kw = dict(name="x", max_num_seqs=16, kv_capacity_tokens=10_000, max_batched_tokens=512)
    prof = fit_profile(steps((32, 160)), **kw)
    assert prof.verify_context_s_per_token == pytest.approx(6e-6, rel=1e-6)
    m = ProfileCostModel(prof)
    # a point's measured times come back at both of its contexts, the per-request cost in the table
    assert m.verify_s(16, 16 * 160) == pytest.approx(0.02 + 0.016 + 0.032 + 6e-6 * 16 * 160, rel=1e-6)
    assert m.verify_s(4, 4 * 32) == pytest.approx(0.02 + 0.004 + 0.008 + 6e-6 * 4 * 32, rel=1e-6)
    assert m.verify_s(32, 0) == pytest.approx(0.02 + 0.032 + 0.032, rel=1e-6)
    one = fit_profile(steps((128,)), **kw)
    assert one.verify_context_s_per_token == 0.0  # the control: within a point the context barely moves


def test_host_time_is_a_line_over_the_batch_with_a_falling_line_as_the_control():
    """Decode steps' host time 1.5 ms + 0.12 ms per request (a 16-request step 3.42 ms): the fit
    finds both, and the step prices 16 requests at 3.42 ms where the old median of all would
    charge every step alike. Control: host time falling with the batch gives the median of all
    and no per-request part."""
    def steps(host):
        return [StepSample(b, "none", 0, b, 100 * b, 0.02 + 0.001 * b, 0.0, host(b)) for b in (1, 2, 4, 8, 16)
                for _ in range(3)]

    kw = dict(name="x", max_num_seqs=16, kv_capacity_tokens=10_000, max_batched_tokens=512, context_term=False)
    prof = fit_profile(steps(lambda b: 0.0015 + 0.00012 * b), **kw)
    assert prof.step_overhead_s == pytest.approx(0.0015) and prof.step_overhead_s_per_request == pytest.approx(0.00012)
    m = ProfileCostModel(prof)
    assert m.step(16, 0, np.zeros(1), 0, 0.0, requests=16).other_s == pytest.approx(0.00342)
    assert m.step(1, 0, np.zeros(1), 0, 0.0, requests=1).other_s == pytest.approx(0.00162)
    falling = fit_profile(steps(lambda b: 0.004 - 0.0001 * b), **kw)
    assert falling.step_overhead_s_per_request == 0.0 and falling.step_overhead_s == pytest.approx(0.004 - 0.0004)


def test_fit_profile_needs_steps():
    with pytest.raises(ValueError, match="no steps"):
        fit_profile([], name="x", max_num_seqs=1, kv_capacity_tokens=1, max_batched_tokens=1)


def test_fit_profile_falls_back_to_tokens_alone_when_context_is_confounded():
    # context grows exactly with tokens and the times carry noise: the joint fit is unusable
    samples = [StepSample(b, "none", 0, b, 100 * b, 0.04 + 0.001 * b + (0.003 if b % 2 else -0.003), 0.0, 0.001)
               for b in (1, 2, 3, 4, 5, 6)]
    prof = fit_profile(samples, name="x", max_num_seqs=6, kv_capacity_tokens=100, max_batched_tokens=64)
    assert prof.verify_context_s_per_token >= 0.0
    assert all(0.03 < v < 0.06 for v in prof.verify_s)


def test_fit_profile_without_the_context_term_keeps_the_price_of_tokens():
    # per-request cost rises with the batch, and so do context and tokens: the joint fit may
    # put it all on the context; the table alone keeps a candidate's price at a fixed batch
    samples = []
    for b in (1, 2, 4):
        for k in (0, 1, 3):
            tokens, ctx = b * (k + 1), 200 * b
            samples.append(StepSample(b, "ngram" if k else "none", k, tokens, ctx, 0.02 + 0.001 * tokens + 0.002 * b,
                                      1e-4 * b if k else 0.0, 0.001))
    prof = fit_profile(samples, name="x", max_num_seqs=4, kv_capacity_tokens=1000, max_batched_tokens=64,
                       context_term=False)
    assert prof.verify_context_s_per_token == 0.0
    assert all(b > a for a, b in zip(prof.verify_s, prof.verify_s[1:])) or prof.verify_s == sorted(prof.verify_s)
    m = ProfileCostModel(prof)
    assert m.verify_s(16, 0) > m.verify_s(4, 0) + 0.01  # 12 more tokens are not free


def test_prefill_steps_host_time_goes_with_their_tokens_not_into_every_steps_overhead(tmp_path):
    """Decode steps: 1.4 ms of host work. Prefill chunks (as many samples as decode steps, as
    the larger batches give): 9.5 ms, their prompts' host work. The overhead is the decode
    steps' 1.4 ms; a prefill chunk's extra 8.1 ms joins its tokens' price. Control: with the
    prefill samples in the median the overhead reads their 9.5 ms. Refitting the written
    steps gives the same profile."""
    samples = [StepSample(1, "none", 0, 1, 130, 0.017, 0.0, 0.0014) for _ in range(5)]
    samples += [StepSample(b, "prefill", 0, 256, 256, 0.40, 0.0001, 0.0095) for b in (4, 8, 16) for _ in range(2)]
    prof = fit_profile(samples, name="x", max_num_seqs=16, kv_capacity_tokens=1000, max_batched_tokens=256,
                       context_term=False)
    assert prof.step_overhead_s == pytest.approx(0.0014)
    assert prof.verify_s[-1] == pytest.approx(0.40 + 0.0081 + 0.0001)
    assert float(np.median([s.other_s for s in samples])) == pytest.approx(0.0095)  # the control
    from adaptspec.sim.calibrate import refit

    csv = tmp_path / "p.steps.csv"
    csv.write_text("batch_size,drafter,k,verify_tokens,context_tokens,verify_s,draft_s,other_s\n" + "".join(
        f"{x.batch_size},{x.drafter},{x.k},{x.verify_tokens},{x.context_tokens},{x.verify_s},{x.draft_s},{x.other_s}\n"
        for x in samples))
    ProfileCostModel(prof).save(tmp_path / "p.json")
    again = ProfileCostModel.load(refit(csv, tmp_path / "q.json", like=tmp_path / "p.json")).profile
    assert again.verify_s == prof.verify_s and again.step_overhead_s == prof.step_overhead_s
    assert again.max_batched_tokens == 256 and again.notes[-1] == "refitted from p.steps.csv"
    from typer.testing import CliRunner

    from adaptspec.cli import app

    res = CliRunner().invoke(app, ["calibrate", "--from-steps", str(csv), "--out", str(tmp_path / "r.json"),
                                   "--no-context-term"])
    assert res.exit_code == 0, res.output
    assert ProfileCostModel.load(tmp_path / "r.json").profile.verify_s == prof.verify_s
    bad = CliRunner().invoke(app, ["calibrate", "--from-steps", str(tmp_path / "nope.csv")])
    assert bad.exit_code == 2 and "--from-steps" in bad.output


def test_prompt_passes_make_the_prompt_table_and_leave_the_admission_steps_out_of_the_verify_table():
    """One-request prompt passes (drafter ``prompt``) at 16 and 64 tokens: the prompt table is
    their median time beyond the overhead, made non-decreasing. The admission steps (drafter
    ``prefill``: prompt and decode tokens mixed) then stay out of the verify table: at 16 tokens
    it keeps the decode steps' 0.05 s. Control: without prompt samples the same admission
    steps pool into the verify table's 16-token level."""
    dec = [StepSample(16, "none", 0, 16, 2000, 0.05, 0.0, 0.001) for _ in range(3)]
    dec += [StepSample(1, "none", 0, 1, 130, 0.02, 0.0, 0.001) for _ in range(3)]
    adm = [StepSample(4, "prefill", 0, 16, 500, 0.03, 0.0, 0.001) for _ in range(6)]
    prompt = [StepSample(1, "prompt", 0, 16, 16, t, 0.0, 0.003) for t in (0.025, 0.03, 0.035)]
    prompt += [StepSample(1, "prompt", 0, 64, 64, t, 0.0, 0.001) for t in (0.024, 0.026, 0.028)]  # a fast reading
    kw = dict(name="x", max_num_seqs=16, kv_capacity_tokens=1000, max_batched_tokens=256, context_term=False)
    prof = fit_profile(dec + adm + prompt, **kw)
    assert prof.verify_tokens == [1.0, 16.0] and prof.verify_s == pytest.approx([0.02, 0.05])
    assert prof.prefill_tokens == [16.0, 64.0]
    # 16 tokens: median 0.03 + 0.002 host beyond the overhead; 64 tokens read faster: pooled with it
    assert prof.prefill_s == pytest.approx([(0.032 + 0.026) / 2] * 2)
    assert prof.notes[0].endswith(f"from {len(dec + adm + prompt)} steps")
    control = fit_profile(dec + adm, **kw)
    assert control.prefill_tokens == [] and control.verify_s[-1] < 0.05  # the admission steps pulled it down
    with pytest.raises(ValueError, match="decode steps"):
        fit_profile(prompt, **kw)


def test_isotonic_fit_pools_a_slow_level_with_its_neighbours():
    from adaptspec.sim.calibrate import _isotonic

    y = np.array([1.0, 2.0, 9.0, 3.0, 4.0, 10.0])
    out = _isotonic(y, np.ones(6))
    assert out.tolist() == pytest.approx([1.0, 2.0, 16 / 3, 16 / 3, 16 / 3, 10.0])
    assert np.maximum.accumulate(y).tolist() == [1, 2, 9, 9, 9, 10]  # what a running maximum gives
    assert _isotonic(np.array([3.0, 1.0]), np.array([1.0, 3.0])).tolist() == pytest.approx([1.5, 1.5])


def test_calibration_times_decode_steps_of_a_batch_whose_prompts_take_several_steps(tiny_dir, tmp_path):
    """8 prompts of 128 tokens are 1024 prompt tokens, four steps of the engine's 256-token
    budget: the calibration waits them out, then times decode steps of all 8 (it used to stop
    at the first step with fewer than 8 decoding, and kept no decode step of a batch above 2)."""
    import csv

    from adaptspec.sim.calibrate import calibrate

    out = calibrate(tmp_path / "p.json", target=str(tiny_dir), draft=None, dtype="float32", device="cpu",
                    repeats=2, batch_sizes=(1, 8), ks=(2,), prefill=True)
    rows = list(csv.DictReader(open(out.with_suffix(".steps.csv"))))
    decode = [r for r in rows if r["drafter"] not in ("prefill", "prompt")]
    assert {(r["batch_size"], r["drafter"]) for r in decode} == {(b, d) for b in ("1", "8") for d in ("none", "ngram")}
    assert all(int(r["verify_tokens"]) >= 8 for r in decode if r["batch_size"] == "8")
    chunks = [r for r in rows if r["drafter"] == "prefill" and r["batch_size"] == "8"]
    assert len(chunks) >= 2 * 4  # each of the two points prefilled in four budgeted steps or more
    probe = ProfileCostModel.load(out).profile.probe  # the speed reference, probed at the start and the end
    assert probe is not None and probe.batch_sizes == [1, 8] and min(probe.start_s + probe.end_s) > 0
    assert not any(r["drafter"] == "probe" for r in rows)  # the probes' steps are no samples
    # one-request prompt passes at each default length (two passes x two repeats), nothing decoded in them
    prompt = [r for r in rows if r["drafter"] == "prompt"]
    assert sorted({int(r["verify_tokens"]) for r in prompt}) == [8, 16, 32, 64, 128]
    assert all(sum(int(r["verify_tokens"]) == n for r in prompt) == 4 for n in (8, 16, 32, 64, 128))
    assert ProfileCostModel.load(out).profile.prefill_tokens == [8.0, 16.0, 32.0, 64.0, 128.0]


def test_calibration_passes_alternate_the_grid_order_so_drift_spreads_over_every_point(tiny_dir, tmp_path):
    """Two passes: the grid in order, then reversed (the machine slowing down during a
    calibration must not land on the large batches alone); passes < 1 is refused by name."""
    import csv
    from itertools import groupby

    from adaptspec.sim.calibrate import calibrate

    out = calibrate(tmp_path / "p.json", target=str(tiny_dir), draft=None, dtype="float32", device="cpu",
                    repeats=1, batch_sizes=(1, 2), ks=(2,), probe=False, passes=2)
    rows = [r for r in csv.DictReader(open(out.with_suffix(".steps.csv"))) if r["drafter"] != "prefill"]
    blocks = [key for key, _ in groupby((r["batch_size"], r["drafter"]) for r in rows)]
    assert blocks == [("1", "none"), ("1", "ngram"), ("2", "none"), ("2", "ngram"), ("2", "none"), ("1", "ngram"),
                      ("1", "none")]
    with pytest.raises(ValueError, match="passes"):  # refused before any model loads: no such model here
        calibrate(tmp_path / "q.json", target=str(tmp_path / "no-such-model"), draft=None, dtype="float32",
                  device="cpu", repeats=1, batch_sizes=(1,), ks=(2,), probe=False, passes=0)


def test_calibration_warms_every_shape_in_an_untimed_pass_first_with_a_control(tiny_dir, tmp_path, monkeypatch):
    """With the warm-up the engine runs the grid once more before the timed passes and keeps
    none of it: the steps CSV holds the same points, each row naming its pass (0 and 1), and
    the profile says it was warmed. Control: without it the engine runs about a third fewer
    steps for the same rows."""
    import csv

    from adaptspec import Engine
    from adaptspec.sim.calibrate import calibrate

    calls = []
    step = Engine.step

    def counting(self, *a, **k):
        calls.append(1)
        return step(self, *a, **k)

    monkeypatch.setattr(Engine, "step", counting)
    got = {}
    for warm in (True, False):
        calls.clear()
        out = calibrate(tmp_path / f"{warm}.json", target=str(tiny_dir), draft=None, dtype="float32", device="cpu",
                        repeats=2, batch_sizes=(1, 2), ks=(2,), probe=False, passes=2, warmup=warm)
        rows = list(csv.DictReader(open(out.with_suffix(".steps.csv"))))
        got[warm] = (len(calls), [(r["batch_size"], r["drafter"], r["pass"]) for r in rows],
                     ProfileCostModel.load(out).profile.notes)
    assert got[True][1] == got[False][1] and {p for *_, p in got[True][1]} == {"0", "1"}
    assert got[False][0] < got[True][0] and got[True][0] == pytest.approx(1.5 * got[False][0], rel=0.2)
    assert "after an untimed warm-up pass over the grid" in got[True][2]
    assert not any("warm-up" in n for n in got[False][2])


def test_calibration_points_take_the_prompt_lengths_in_turn_so_each_meets_every_context(tiny_dir, tmp_path):
    """Prompt lengths (16, 48) over two passes: in a pass the points alternate lengths, and the
    next pass gives each point the other one, so every (batch, arm) is measured at both contexts;
    a length < 1 is refused by name."""
    import csv

    from adaptspec.sim.calibrate import calibrate

    out = calibrate(tmp_path / "p.json", target=str(tiny_dir), draft=None, dtype="float32", device="cpu",
                    repeats=1, batch_sizes=(1, 2), ks=(2,), probe=False, passes=2, prompt_tokens=(16, 48))
    rows = [r for r in csv.DictReader(open(out.with_suffix(".steps.csv"))) if r["drafter"] != "prefill"]
    seen: dict = {}
    for r in rows:  # context per request rounded down to the prompt length it started from
        b = int(r["batch_size"])
        seen.setdefault((b, r["drafter"]), set()).add(16 if int(r["context_tokens"]) // b < 48 else 48)
    assert seen == {(1, "none"): {16, 48}, (1, "ngram"): {16, 48}, (2, "none"): {16, 48}, (2, "ngram"): {16, 48}}
    with pytest.raises(ValueError, match="prompt_tokens"):
        calibrate(tmp_path / "q.json", target=str(tmp_path / "no-such-model"), draft=None, dtype="float32",
                  device="cpu", repeats=1, batch_sizes=(1,), ks=(2,), probe=False, prompt_tokens=(16, 0))


# ---- speed probes and the profile's reference ---------------------------------------------------
def _profile(**extra):
    from adaptspec.control.costs import ProfileFile

    return ProfileFile(name="p", verify_tokens=[1.0, 8.0], verify_s=[0.010, 0.020], verify_context_s_per_token=1e-6,
                       draft_batch=[1.0, 4.0], draft_s=[0.002, 0.004], draft_context_s_per_token=2e-7,
                       ngram_s_per_request=1e-4, step_overhead_s=0.0014, step_overhead_s_per_request=1e-4,
                       kv_capacity_tokens=4096, max_num_seqs=8,
                       max_batched_tokens=256, calibrated=True, notes=["n"], **extra)


def test_profile_scaled_multiplies_exactly_the_time_fields():
    from adaptspec.control.costs import TIME_FIELDS, SpeedProbeRef

    p = _profile(probe=SpeedProbeRef(batch_sizes=[1, 8], start_s=[0.01, 0.02], end_s=[0.012, 0.022]),
                 prefill_tokens=[16.0, 64.0], prefill_s=[0.015, 0.04])
    q = p.scaled(2.5)
    a, b = p.model_dump(), q.model_dump()
    assert set(TIME_FIELDS) == {"verify_s", "verify_context_s_per_token", "draft_s", "draft_context_s_per_token",
                                "ngram_s_per_request", "step_overhead_s", "step_overhead_s_per_request",
                                "prefill_s"}
    for k in a:
        if k in TIME_FIELDS:
            want = [2.5 * x for x in a[k]] if isinstance(a[k], list) else 2.5 * a[k]
            assert b[k] == pytest.approx(want), k
            assert b[k] != a[k], k  # every time field is nonzero here: the check can fail
        else:
            assert b[k] == a[k], k  # limits, token counts, notes, the probe itself
    m, m2 = ProfileCostModel(p), ProfileCostModel(q)
    args = (12, 300.0, np.array([2.0, 1.0]), 3, 100.0)
    assert m2.step(*args).wall_s == pytest.approx(2.5 * m.step(*args).wall_s)
    assert m2.step(*args, prompt_tokens=8).wall_s == pytest.approx(2.5 * m.step(*args, prompt_tokens=8).wall_s)
    assert m2.step(*args, requests=5).other_s == pytest.approx(2.5 * (0.0014 + 5e-4))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="factor"):
            p.scaled(bad)


def test_old_profiles_without_a_probe_still_load_and_new_ones_keep_it(tmp_path):
    import json

    from adaptspec.control.costs import SpeedProbeRef

    old = _profile().model_dump()
    old.pop("probe")
    (tmp_path / "old.json").write_text(json.dumps(old))
    m = ProfileCostModel.load(tmp_path / "old.json")
    assert m.profile.probe is None
    m.save(tmp_path / "again.json")
    assert "probe" not in json.loads((tmp_path / "again.json").read_text())  # as an older reader expects
    ref = SpeedProbeRef(batch_sizes=[1, 8], start_s=[0.010, 0.030], end_s=[0.014, 0.034])
    ProfileCostModel(_profile(probe=ref)).save(tmp_path / "new.json")
    back = ProfileCostModel.load(tmp_path / "new.json").profile.probe
    assert back == ref and back.reference() == pytest.approx({1: 0.012, 8: 0.032})
    bad = {**old, "probe": {"batch_sizes": [1, 8], "start_s": [0.01], "end_s": [0.01, 0.02]}}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="probe"):
        ProfileCostModel.load(tmp_path / "bad.json")


def test_speed_factor_is_the_geometric_mean_of_the_shared_batch_sizes_ratios():
    import math

    from adaptspec.sim.speed_probe import mean_probe, speed_factor, speed_ratios, summary

    ref = {1: 0.010, 8: 0.040}
    assert speed_ratios({1: 0.015, 8: 0.040, 16: 1.0}, ref) == pytest.approx({1: 1.5, 8: 1.0})
    assert speed_factor({1: 0.020, 8: 0.020}, ref) == pytest.approx(1.0)  # 2 and 1/2 weigh alike
    assert speed_factor({1: 0.020, 8: 0.080}, ref) == pytest.approx(2.0)
    assert math.isnan(speed_factor({4: 0.02}, ref))
    assert mean_probe({1: 0.01, 8: 0.03}, {1: 0.02}) == pytest.approx({1: 0.015, 8: 0.03})
    assert summary([1.2, float("nan"), 0.9, 1.0]) == {"probed_runs": 3, "min": 0.9, "median": 1.0, "max": 1.2}


def test_speed_probe_times_decode_steps_and_leaves_the_engine_idle_and_its_listeners_blind(tiny_dir):
    from adaptspec import Engine, SamplingParams

    from adaptspec.sim.speed_probe import speed_probe

    eng = Engine.from_pretrained(target=str(tiny_dir), dtype="float32", device="cpu", max_num_seqs=4,
                                 max_model_len=256, max_num_batched_tokens=64)
    heard = []
    eng.step_listeners.append(heard.append)
    listeners = eng.step_listeners
    got = speed_probe(eng, batch_sizes=(1, 8), steps=3)
    assert set(got) == {1, 4}  # 8 requests do not fit 4 KV slots: the probe takes 4
    assert all(s > 0 for s in got.values())
    assert not eng.has_unfinished() and not eng.requests
    assert eng.step_listeners is listeners and heard == []  # no load-test log saw the probe's steps
    # the engine works as before, and its listeners hear it again
    out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, ignore_eos=True), raw=True)
    assert len(out[0].token_ids) == 3 and heard
    eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=3), raw=True)
    with pytest.raises(ValueError, match="idle"):
        speed_probe(eng)


def test_prompt_probe_times_fresh_prompt_passes_and_leaves_the_engine_idle_and_its_listeners_blind(tiny_dir):
    """One-request passes of fresh prompts at each length (none served by the prefix cache,
    though every call prefills the same lengths); a length over the step's token budget is
    left out; the engine is idle after and its listeners heard nothing. Control: the speed
    probe's fixed prompts do hit the cache the second time."""
    from adaptspec import Engine, SamplingParams

    from adaptspec.sim.speed_probe import prompt_probe, speed_probe

    eng = Engine.from_pretrained(target=str(tiny_dir), dtype="float32", device="cpu", max_num_seqs=4,
                                 max_model_len=256, max_num_batched_tokens=64)
    heard = []
    eng.step_listeners.append(heard.append)
    hits = eng.pool.hits
    first = prompt_probe(eng, lengths=(8, 32, 100), repeats=2)
    second = prompt_probe(eng, lengths=(8, 32), repeats=2)
    assert set(first) == {8, 32} and set(second) == {8, 32}
    assert all(s > 0 for s in (*first.values(), *second.values()))
    assert eng.pool.hits == hits  # fresh ids every pass: nothing was served from the cache
    assert not eng.has_unfinished() and not eng.requests and heard == []
    speed_probe(eng, batch_sizes=(1,), steps=1)
    before = eng.pool.hits
    speed_probe(eng, batch_sizes=(1,), steps=1)
    assert eng.pool.hits > before  # the control: the speed probe's fixed prompt is served again
    out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, ignore_eos=True), raw=True)
    assert len(out[0].token_ids) == 2 and heard
    eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=3), raw=True)
    with pytest.raises(ValueError, match="idle"):
        prompt_probe(eng)


def test_prompt_passes_time_requests_that_go_on_decoding_as_live_requests_do(tiny_dir):
    """A live request goes on past its prompt pass, so its pass pays the commit work of a
    continuing request (a draft head reads the prompt's features there); a prompt table timed
    on requests that end at their first token left that out and made simulated TTFT short.
    Every timed pass is of a request still running when the pass ends (then aborted: the
    engine is idle after). Control: a request asking for one token has finished by then."""
    from adaptspec import Engine, SamplingParams, SpecConfig

    from adaptspec.sim.calibrate import _prompt_passes

    eng = Engine.from_pretrained(target=str(tiny_dir), dtype="float32", device="cpu", max_num_seqs=4,
                                 max_model_len=256, max_num_batched_tokens=64)
    running_at_abort, abort = [], eng.abort

    def spy(rid):
        running_at_abort.append(rid in eng.requests and not eng.requests[rid].finished)
        return abort(rid)

    eng.abort = spy
    got = _prompt_passes(eng, 16, 3, np.random.default_rng(0), int(eng.target.vocab_size))
    assert len(got) == 3 and all(g.drafter == "prompt" and g.verify_tokens == 16 for g in got)
    assert running_at_abort == [True] * 3
    assert not eng.has_unfinished() and not eng.requests
    eng.abort = abort
    rid = eng.add_request([t % 16 for t in range(16)], SamplingParams(max_new_tokens=1, ignore_eos=True),
                          SpecConfig("none", 0), raw=True)
    eng.step()
    assert rid not in eng.requests  # the control: asking for one token, it ended in its pass


def test_prompt_factor_is_live_passes_over_the_profiles_prompt_table():
    import math

    from adaptspec.control.costs import ProfileFile
    from adaptspec.sim.speed_probe import prompt_factor

    prof = ProfileFile(name="t", verify_tokens=[1.0], verify_s=[0.01], step_overhead_s=0.001,
                       prefill_tokens=[8.0, 32.0], prefill_s=[0.020, 0.050])
    # beyond the 1 ms overhead: 8 tokens 0.030 / 0.020 = 1.5; 16 (the table there: 0.030) 1.0; 32: 0.5
    got = prompt_factor({8: 0.031, 16: 0.031, 32: 0.026}, prof)
    assert got == pytest.approx(math.exp((math.log(1.5) + math.log(1.0) + math.log(0.5)) / 3))
    assert math.isnan(prompt_factor({}, prof))
    assert math.isnan(prompt_factor({8: 0.03}, prof.model_copy(update={"prefill_tokens": [], "prefill_s": []})))
    # the profile scaled with its own prompt factor: the prompt table moves alone
    s = prof.scaled(2.0, prompt_factor=0.5)
    assert s.verify_s == [0.02] and s.prefill_s == pytest.approx([0.010, 0.025])
    assert prof.scaled(2.0).prefill_s == pytest.approx([0.040, 0.100])
    with pytest.raises(ValueError, match="prompt_factor"):
        prof.scaled(1.0, prompt_factor=0.0)


def test_repeatability_summarises_back_to_back_probes_and_the_cli_refuses_bad_options_by_name():
    """Three probes at batch 1 (10, 12, 14 ms) and two at batch 8: median, range and the
    coefficient of variation (population sd / mean). Control: identical readings give CV 0."""
    from typer.testing import CliRunner

    from adaptspec.cli import app
    from adaptspec.sim.speed_probe import repeatability

    r = repeatability([{1: 0.010, 8: 0.020}, {1: 0.012}, {1: 0.014, 8: 0.030}])
    assert r[1]["n"] == 3 and r[1]["median_s"] == pytest.approx(0.012)
    assert (r[1]["min_s"], r[1]["max_s"]) == pytest.approx((0.010, 0.014))
    assert r[1]["cv"] == pytest.approx(np.std([10, 12, 14]) / 12)
    assert r[8]["n"] == 2 and r[8]["cv"] == pytest.approx(0.2)
    assert repeatability([{1: 0.01}, {1: 0.01}])[1]["cv"] == 0.0  # the control
    for args, field in ((["--seconds", "0"], "--seconds"), (["--steps", "0"], "--steps"),
                        (["--threads", "0"], "--threads"), (["--batch", "1,x"], "--batch")):
        res = CliRunner().invoke(app, ["speed-probe", *args])
        assert res.exit_code == 2 and field in res.output, (args, res.output)



def test_calibrate_with_a_service_config_measures_the_engine_it_builds(tiny_dir, tmp_path):
    """`adaptspec calibrate --config` measures what a load test of that config runs (its model,
    dtype, torch threads, and the grid cut to its max_num_seqs and max_k), so its profile can be
    named as that config's cost prior; --threads without --config, and a config that is not
    there, are refused by name."""
    import csv

    import torch
    import yaml
    from typer.testing import CliRunner

    from adaptspec.cli import app

    cfg = tmp_path / "svc.yaml"
    cfg.write_text(yaml.safe_dump({"models": {"target": str(tiny_dir), "draft": None, "dtype": "float32"},
                                   "engine": {"max_num_seqs": 2, "torch_threads": 1}, "controller": {"max_k": 2}}))
    threads = torch.get_num_threads()
    try:
        res = CliRunner().invoke(app, ["calibrate", "--config", str(cfg), "--out", str(tmp_path / "p.json")])
    finally:
        torch.set_num_threads(threads)
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(open(tmp_path / "p.steps.csv")))
    decode = {(r["batch_size"], r["drafter"], r["k"]) for r in rows if r["drafter"] in ("none", "ngram")}
    assert {b for b, _, _ in decode} == {"1", "2"} and {k for _, d, k in decode if d == "ngram"} == {"2"}
    assert ProfileCostModel.load(tmp_path / "p.json").profile.prefill_tokens  # the prompt table too
    for args, field in ((["--threads", "1"], "--threads"), (["--config", str(tmp_path / "nope.yaml")], "nope.yaml")):
        bad = CliRunner().invoke(app, ["calibrate", *args, "--out", str(tmp_path / "q.json")])
        assert bad.exit_code == 2 and field in bad.output, (args, bad.output)
