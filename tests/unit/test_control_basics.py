"""Controller building blocks: arms, outcomes, posteriors, the online cost model, the planner."""
import numpy as np
import pytest

from adaptspec.control import (
    NO_SPEC,
    Arm,
    ClassTarget,
    Load,
    ModelBasedThompson,
    OnlineStepCost,
    PolicyConfig,
    RequestOutcome,
    StaticPolicy,
    StepOutcome,
)
from adaptspec.control.acceptance import DiscountedBeta, accepted_length_curve, successes_failures
from adaptspec.control.planner import RATIO_TIE, BatchPicture, Planner, ArmTable


def test_arm_validation_and_normalisation():
    assert Arm("draft", 0) == NO_SPEC  # k = 0 is always "no drafting"
    assert Arm("none", 3) == NO_SPEC
    with pytest.raises(ValueError, match="drafter"):
        Arm("medusa", 2)
    with pytest.raises(ValueError, match=r"\bk\b"):
        Arm("draft", 17)
    assert str(Arm("ngram", 4)) == "ngram:4"


def test_step_outcome_from_requests_groups_by_class_and_arm():
    reqs = [
        RequestOutcome("a", "chat", "draft", 4, 2, 3),
        RequestOutcome("b", "chat", "draft", 4, 4, 5),
        RequestOutcome("c", "chat", "draft", 4, 0, 1),
        RequestOutcome("d", "code", "ngram", 2, 1, 2),
    ]
    out = StepOutcome.from_requests(reqs, batch_size=4, num_prefill=0, verify_tokens=18, context_tokens=100,
                                    draft_s=0.01, verify_s=0.02, other_s=0.001, wall_s=0.031)
    groups = {(g.request_class, str(g.arm)): g for g in out.groups}
    chat = groups[("chat", "draft:4")]
    # accepted 2, 4, 0 of 4: histogram over 0..4
    assert chat.accepted_hist.tolist() == [1, 0, 1, 0, 1]
    assert chat.num_requests == 3 and chat.accepted == 6 and chat.emitted == 9
    assert groups[("code", "ngram:2")].accepted_hist.tolist() == [0, 1, 0]
    # without the proposed count a request is taken to have proposed all k
    assert chat.drafted == 12 and groups[("code", "ngram:2")].drafted == 2
    short = StepOutcome.from_requests([RequestOutcome("e", "code", "ngram", 4, 0, 1, 0),
                                       RequestOutcome("f", "code", "ngram", 4, 1, 2, 2)],
                                      batch_size=2, num_prefill=0, verify_tokens=5, context_tokens=10,
                                      draft_s=0.0, verify_s=0.01, other_s=0.0, wall_s=0.01)
    assert short.groups[0].drafted == 2 and short.groups[0].num_requests == 2


def test_successes_and_failures_per_position():
    # 3 requests accepted 0, 1 requests accepted 2, 2 requests accepted all 3:
    # position 1: successes = 3 (those with >= 1), failures = 3 (accepted 0 failed at 1)
    # position 2: successes = 3, failures = 0; position 3: successes 2, failures 1
    s, f = successes_failures(np.array([3, 0, 1, 2]))
    assert s.tolist() == [3, 3, 2] and f.tolist() == [3, 0, 1]
    post = DiscountedBeta(4, discount=1.0)
    post.update(np.array([3, 0, 1, 2]))
    assert post.a[0].tolist() == [4, 4, 3, 1]  # prior 1 + successes; position 4 unobserved
    assert post.b[0].tolist() == [4, 1, 2, 1]


def test_discount_forgets_toward_prior():
    post = DiscountedBeta(2, discount=0.5)
    post.update(np.array([0, 0, 10]))
    post.update(np.array([0, 0, 0]))  # an empty step only decays
    assert post.a[0, 0] == pytest.approx(1 + 5)


def test_fade_keeps_a_fraction_of_every_rows_evidence_beyond_the_prior():
    post = DiscountedBeta(2, rows=2, discount=1.0, prior_a=1.0, prior_b=2.0)
    post.update(np.array([4, 0, 8]), row=0)
    post.update(np.array([2, 6]), row=1)
    a, b = post.a.copy(), post.b.copy()
    post.fade(1.0)  # no time passed: nothing changes
    assert (post.a == a).all() and (post.b == b).all()
    post.fade(0.25)  # both rows, the one that ran last and the one that did not
    assert post.a == pytest.approx(1.0 + 0.25 * (a - 1.0)) and post.b == pytest.approx(2.0 + 0.25 * (b - 2.0))
    assert post.a[1, 1] == 1.0 and post.b[1, 1] == 2.0  # an unobserved position stays at the prior
    for _ in range(60):
        post.fade(0.5)
    assert post.mean() == pytest.approx(np.full((2, 2), 1 / 3))  # all evidence gone: the prior's mean


def test_accepted_length_curve_matches_closed_form():
    for a in (0.3, 0.6, 0.9):
        L = accepted_length_curve(np.full(8, a))
        for k in range(9):
            assert L[k] == pytest.approx((1 - a ** (k + 1)) / (1 - a))


def _steps(cost_fn, n=400, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        tokens = int(rng.integers(1, 3000))
        ctx = int(rng.integers(0, 200_000))
        yield tokens, ctx, cost_fn(tokens, ctx)


def test_online_cost_model_learns_a_piecewise_linear_verify_curve():
    def true_verify(n, ctx):  # flat to 256 tokens, then 20 us per token, plus KV reads
        return 0.006 + 2e-5 * max(n - 256, 0) + 5e-8 * ctx

    model = OnlineStepCost(discount=1.0)
    for tokens, ctx, y in _steps(true_verify):
        model.observe(StepOutcome(1, 0, tokens, ctx, 0.0, y, 0.0, y), np.zeros(8), 0, 0.0)
    for n in (1, 128, 512, 2048):
        pred = model.predict(np.array([float(n)]), 50_000, np.zeros(8), 0.0, np.zeros(1), np.zeros(1), 0.0)[0]
        assert pred == pytest.approx(true_verify(n, 50_000), rel=0.03)


def test_planner_keeps_a_throughput_class_within_a_latency_class_budget():
    class Linear:  # step time: 5 ms + 1 ms per verified token
        def predict(self, verify, ctx, draft_other, n_class, k_draft, ngram, mean_ctx):
            return 0.005 + 0.001 * np.asarray(verify, dtype=float)

    table = ArmTable.build(("draft",), 8)
    L = np.concatenate([[1.0], accepted_length_curve(np.full(8, 0.95))[1:]])
    picture = BatchPicture()
    picture.observe(_two_class_step())
    others = {"chat": 2.0}  # chat's current arm emits 2 tokens per step
    free = Planner(table, {}).plan("batch", Load(8), picture, L, others, Linear())
    tight = Planner(table, {"chat": ClassTarget("chat", tpot_s=0.02)}).plan("batch", Load(8), picture, L, others, Linear())
    # 4 chat requests verify 3 tokens each (draft:2); 4 batch requests verify k + 1 each.
    # Without a target, goodput peaks at k = 6; chat's budget 0.9 * 20 ms * 2 = 36 ms allows
    # 17 ms + 4 ms (k + 1) <= 36 ms, i.e. k <= 3, and k = 3 has the best goodput among those.
    assert table.k[free] == 6
    assert table.k[tight] == 3


def test_planner_without_a_feasible_arm_takes_the_one_closest_to_the_targets_unless_requests_queue():
    class Linear:  # step time: 5 ms + 1 ms per verified token
        def predict(self, verify, ctx, draft_other, n_class, k_draft, ngram, mean_ctx):
            return 0.005 + 0.001 * np.asarray(verify, dtype=float)

    table = ArmTable.build(("draft",), 8)
    L = np.concatenate([[1.0], accepted_length_curve(np.full(8, 0.95))[1:]])
    picture = BatchPicture()
    picture.observe(_two_class_step())
    # chat's 5 ms target leaves a budget of 0.9 * 5 ms * 2 = 9 ms; the step takes
    # 5 ms + 12 ms (chat) + 4 ms (k + 1) >= 21 ms whatever the batch class picks: nothing fits.
    planner = Planner(table, {"chat": ClassTarget("chat", tpot_s=0.005)})
    idle = planner.plan("batch", Load(8, queued=0), picture, L, {"chat": 2.0}, Linear())
    queued = planner.plan("batch", Load(8, queued=3), picture, L, {"chat": 2.0}, Linear())
    # nobody waits: take the step that comes closest to chat's budget (the shortest, k = 0);
    # requests wait for admission: their TTFT needs throughput, so take the best goodput (k = 6)
    assert table.k[idle] == 0
    assert table.k[queued] == 6
    # a latency class with no feasible arm takes its own lowest predicted TPOT (T / L), ratios
    # within RATIO_TIE of the lowest counting as ties that goodput breaks: batch's 4 requests
    # verify 3 tokens each, chat's 4 verify k + 1; T / L is 7.17 ms at k = 8, 7.28 ms at k = 7
    # (within 2%), 7.46 ms at k = 6 (not), and k = 7 emits more per second of step than k = 8
    own = Planner(table, {"chat": ClassTarget("chat", tpot_s=0.001)}).plan(
        "chat", Load(8), picture, L, {"batch": 2.0}, Linear())
    T = 0.005 + 0.001 * (12 + 4 * (table.k + 1))
    r = T / L
    assert r[8] < r[7] <= r[8] * (1 + RATIO_TIE) < r[6]
    assert table.k[own] == 7


def test_budget_length_is_at_least_the_best_one_candidate_length():
    table = ArmTable.build(("ngram", "draft"), 4)
    # [none, ngram:1..4, draft:1..4]
    lengths = np.array([1.0, 1.2, 1.3, 1.35, 1.4, 1.45, 1.65, 1.74, 1.78])
    assert table.budget_length(lengths, NO_SPEC) == pytest.approx(1.45)  # draft:1 is the best k = 1
    assert table.budget_length(lengths, Arm("ngram", 1)) == pytest.approx(1.45)
    assert table.budget_length(lengths, Arm("draft", 3)) == pytest.approx(1.74)


def _two_class_step():
    from adaptspec.control import GroupOutcome

    groups = [GroupOutcome("chat", Arm("draft", 2), np.array([0, 4, 0]), 8),
              GroupOutcome("batch", Arm("draft", 2), np.array([0, 0, 4]), 12)]
    return StepOutcome(8, 0, 24, 8000, 0.001, 0.02, 0.001, 0.022, groups)


def test_thompson_is_deterministic_for_a_seed_and_uses_the_injected_clock():
    ticks = iter(np.arange(0, 1000, 0.5))

    def run(seed):
        p = ModelBasedThompson(PolicyConfig(seed=seed), clock=lambda: next(ticks))
        arms = []
        for i in range(50):
            arm = p.choose("chat", Load(8, 0, 40, 8000))
            arms.append(arm)
            acc = np.minimum(np.random.default_rng(i).geometric(0.3, 8) - 1, arm.k)
            reqs = [RequestOutcome(str(j), "chat", arm.drafter, arm.k, int(a), int(a) + 1) for j, a in enumerate(acc)]
            p.observe(StepOutcome.from_requests(reqs, batch_size=8, num_prefill=0, verify_tokens=8 * (arm.k + 1),
                                                context_tokens=8000, draft_s=0.001 * arm.k, verify_s=0.01,
                                                other_s=0.001, wall_s=0.012 + 0.001 * arm.k))
        return arms, p.stats

    a1, s1 = run(7)
    a2, _ = run(7)
    a3, _ = run(8)
    assert a1 == a2
    assert a1 != a3
    assert s1.decisions == 50 and s1.decision_s_total == pytest.approx(50 * 0.5)  # the fake clock ticks 0.5


def test_static_policy_counts_arms():
    p = StaticPolicy(Arm("draft", 3))
    for _ in range(5):
        assert p.choose("x", Load()) == Arm("draft", 3)
    assert p.stats.arm_counts == {"x": {"draft:3": 5}}


def test_adapter_from_engine_step_stats_fields():
    from types import SimpleNamespace as NS

    reqs = [NS(request_id="a", request_class="chat", drafter="ngram", k=3, drafted=2, accepted=2, emitted=3),
            NS(request_id="b", request_class="chat", drafter="ngram", k=3, drafted=3, accepted=0, emitted=1)]
    st = NS(batch_size=2, prefill_tokens=0, verify_tokens=8, context_tokens=300, draft_s=0.001, verify_s=0.03,
            other_s=0.002, prefill_s=0.01, wall_s=0.043, num_waiting=4, requests=reqs)
    out = StepOutcome.from_step_stats(st)
    (g,) = out.groups
    assert g.arm == Arm("ngram", 3) and g.accepted_hist.tolist() == [1, 0, 1, 0] and g.emitted == 4
    assert g.drafted == 5  # proposed, not asked for (2 x 3)
    # the engine's prefill pass is its own part, not host overhead (see StepOutcome.prefill_s)
    assert out.other_s == pytest.approx(0.002) and out.prefill_s == pytest.approx(0.01)
    assert out.queued == 4 and out.verify_tokens == 8 and out.wall_s == pytest.approx(0.043)


def test_a_separate_prefill_pass_is_no_cost_of_an_arm():
    """The live engine prefills in a pass of its own, the same whatever the arms: a cost model
    that counted it as per-step overhead made verifying more tokens look cheaper the more a
    step prefilled (at 16 clients on the CPU, half a step), and the policy speculated where it
    lost (in-process at c = 16: 0.79 of no speculation). With it apart, the planner ranks arms
    by the decode part alone; the same steps with the prefill booked as overhead (the control)
    pick the speculative arm."""
    from adaptspec.control import GroupOutcome

    def steps(prefill_as_overhead: bool):
        # 16 requests a step; verification costs 20 ms + 1.2 ms a token, prefill 60 ms a step;
        # every fourth step drafts 2 n-gram tokens a request, accepted at positions 1 and 2
        # with p = 0.35 and 0.7 (accepted length 1.6): 0.33 tokens/ms of decode against 0.41
        # without drafting (but 0.18 against 0.16 with the prefill in every step's time)
        out = []
        rng = np.random.default_rng(0)
        for i in range(400):
            k = 2 if i % 4 == 0 else 0
            n = 16
            hist = np.bincount(rng.binomial(1, 0.35, n) * (1 + rng.binomial(1, 0.7, n)), minlength=3) if k else None
            arm = Arm("ngram", 2) if k else Arm("none", 0)
            g = GroupOutcome("x", arm, hist if k else np.array([n]), (int(np.dot(np.arange(3), hist)) if k else 0) + n)
            tokens = n * (k + 1)
            verify = 0.020 + 0.0012 * tokens
            prefill = 0.060
            other = 0.001 + (prefill if prefill_as_overhead else 0.0)
            out.append(StepOutcome(n, 0, tokens, 200 * n, 0.0005 if k else 0.0, verify, other,
                                   verify + other + (0.0 if prefill_as_overhead else prefill) + (0.0005 if k else 0.0),
                                   [g], 0, 0.0 if prefill_as_overhead else prefill))
        return out

    def choice(prefill_as_overhead: bool) -> Arm:
        p = ModelBasedThompson(PolicyConfig(("ngram",), 4, (), seed=0))
        for o in steps(prefill_as_overhead):
            p.observe(o)
        # the planner on the posterior means (no sampling noise)
        mean_lengths = p._lengths("x", sample=False)
        return p.table.arms[p.planner.plan("x", Load(16, 0, 0, 3200), p.picture, mean_lengths, {}, p.cost)]

    assert choice(False) == Arm("none", 0)
    assert choice(True).drafter == "ngram"  # the control: the old booking speculates


def test_planner_charges_n_gram_arms_for_the_candidates_the_class_actually_proposes():
    """n-gram lookup proposes nothing without a match: a class whose requests propose a
    third of the candidates they ask for verifies 1 + k / 3 tokens a request, not k + 1."""
    from adaptspec.control import GroupOutcome

    class Linear:  # step time: 5 ms + 1 ms per verified token
        def predict(self, verify, ctx, draft_other, n_class, k_draft, ngram, mean_ctx):
            return 0.005 + 0.001 * np.asarray(verify, dtype=float)

    table = ArmTable.build(("ngram",), 4)
    L = np.concatenate([[1.0], 1.0 + 0.35 * table.k[1:]])  # 0.35 tokens gained per candidate
    ng2 = table.index(Arm("ngram", 2))

    def step(drafted: int | None) -> StepOutcome:
        g = GroupOutcome("chat", Arm("ngram", 2), np.array([7, 1, 0]), 9, drafted=-1 if drafted is None else drafted)
        return StepOutcome(8, 0, 8 + g.drafted, 800, 0.0, 0.02, 0.0, 0.02, [g])

    def verify_tokens(drafted):
        picture = BatchPicture()
        for _ in range(200):
            picture.observe(step(drafted))
        planner = Planner(table, {})
        arm = planner.plan("chat", Load(8), picture, L, {}, Linear())
        return planner._mix("chat", picture, {}, None).own_tokens, arm

    full, arm_full = verify_tokens(None)  # proposes all k: k + 1 tokens, as before
    assert full.tolist() == (table.k + 1).tolist()
    third, arm_third = verify_tokens(5)  # 5 of the 16 asked for
    assert third[ng2] == pytest.approx(1 + 2 * 5 / 16, rel=0.02)
    assert third[0] == 1.0
    # goodput 8 (1 + 0.35 k) / (13 ms + 8 f k ms) against 8 / 13 ms without drafting: better
    # only when 0.35 > 8 f / 13, i.e. f < 0.57: not when every candidate is verified (f = 1)
    assert table.k[arm_full] == 0
    assert table.arms[arm_third].drafter == "ngram"


def test_classes_sharing_the_draft_forward_are_reconsidered_together():
    """Planned one by one, a class sees the draft forward another class already pays for as
    free; the joint check prices the step with nobody on the draft model as well."""
    from adaptspec.control import GroupOutcome

    class Cost:  # 5 ms + 0.2 ms per verified token + F per draft forward
        def __init__(self, forward_s):
            self.forward_s = forward_s

        def predict(self, verify, ctx, draft_other, n_class, k_draft, ngram, mean_ctx):
            own = np.asarray(k_draft, dtype=float) * (np.asarray(n_class) > 0)
            forwards = np.maximum(own, np.count_nonzero(draft_other))
            return 0.005 + 0.0002 * np.asarray(verify, dtype=float) + self.forward_s * forwards

    table = ArmTable.build(("draft",), 1)
    L = np.array([1.0, 1.3])  # none, draft:1
    picture = BatchPicture()
    step = StepOutcome(4, 0, 8, 800, 0.0, 0.02, 0.0, 0.02,
                       [GroupOutcome("a", Arm("draft", 1), np.array([1, 1]), 3),
                        GroupOutcome("b", Arm("draft", 1), np.array([1, 1]), 3)])
    for _ in range(50):
        picture.observe(step)
    planner = Planner(table, {})
    # one class alone, the other keeping draft:1: the forward is paid anyway, so draft:1
    # (16.6 ms for 5.2 tokens against 16.2 ms for 4.6)
    assert table.arms[planner.plan("a", Load(4), picture, L, {"b": 1.3}, Cost(0.010))] == Arm("draft", 1)
    # both at once: 10 ms of draft forward buys 1.2 tokens; without it 4 tokens in 5.8 ms
    both = planner.plan_many(["a", "b"], Load(4), picture, np.stack([L, L]), {"a": 1.3, "b": 1.3}, Cost(0.010))
    assert [table.arms[i] for i in both] == [NO_SPEC, NO_SPEC]
    # a cheap forward (0.5 ms): drafting together pays (5.2 tokens in 7.1 ms), so it stays
    cheap = planner.plan_many(["a", "b"], Load(4), picture, np.stack([L, L]), {"a": 1.3, "b": 1.3}, Cost(0.0005))
    assert [table.arms[i] for i in cheap] == [Arm("draft", 1), Arm("draft", 1)]
    # a latency target switches the joint check off (the per-class plan keeps the budgets)
    tight = Planner(table, {"a": ClassTarget("a", tpot_s=1.0)})
    kept = tight.plan_many(["a", "b"], Load(4), picture, np.stack([L, L]), {"a": 1.3, "b": 1.3}, Cost(0.010))
    assert [table.arms[i] for i in kept] == [Arm("draft", 1), Arm("draft", 1)]


def test_a_cost_model_seeded_from_a_profile_predicts_the_profile():
    """Seeding fits the profile's curve at every context together (the context term included)
    and keeps its per-step overhead apart (the learned other_s adds it once); discounting
    then keeps the profile as the prior: steps seen only at one size leave the rest of the
    curve where the profile put it."""
    from adaptspec.sim.gpu import builtin_profile

    prof = builtin_profile("h100-8b-1b")
    model = OnlineStepCost()
    model.seed_from(prof, max_k=8)

    def both(n, ctx):
        args = (np.array([float(n)]), ctx, np.zeros(8), 0.0, np.zeros(1), np.zeros(1), ctx / 64)
        return model.predict(*args)[0], prof.predict(*args)[0]

    for n, ctx in ((1, 0.0), (1, 256.0 * 64), (5, 256.0 * 64), (9, 256.0 * 64), (64, 2048.0 * 128), (512, 4096.0)):
        got, want = both(n, ctx)
        assert got == pytest.approx(want, rel=0.08), (n, ctx)  # the old seeding: 0.6-1.6x
    from adaptspec.control.costmodel import _CTX

    verify_ctx = model.verify.coef()[-1] * _CTX  # per context token (the features scale context by _CTX)
    assert verify_ctx == pytest.approx(prof.profile.verify_context_s_per_token, rel=0.25)
    # 300 plain steps at batch 1 (true cost: the profile's): the curve at 5 and 9 tokens holds
    ctx = 256.0 * 64
    for _ in range(300):
        y = prof.step(1, ctx, np.zeros(8), 0, ctx / 64)
        model.observe(StepOutcome(1, 0, 1, ctx, y.draft_s, y.verify_s, y.other_s, y.wall_s), np.zeros(8), 0, ctx / 64)
    for n in (1, 5, 9):
        got, want = both(n, ctx)
        assert got == pytest.approx(want, rel=0.05), n


def _group_step(arm: Arm, accepted: list[int], drafted: int | None = None) -> StepOutcome:
    from adaptspec.control import GroupOutcome

    hist = np.bincount(np.asarray(accepted, dtype=np.int64), minlength=arm.k + 1)
    g = GroupOutcome("x", arm, hist, sum(accepted) + len(accepted), len(accepted),
                     -1 if drafted is None else drafted)
    return StepOutcome(len(accepted), 0, 0, 0, 0.0, 0.01, 0.0, 0.01, [g])


def test_ema_moves_k_with_hysteresis_and_cooldown():
    from adaptspec.control import EmaPolicy

    p = EmaPolicy("draft", PolicyConfig(("draft",), 8), start_k=4, alpha=0.5, up=0.8, down=0.5, cooldown=3)
    assert p.choose("x", Load()) == Arm("draft", 4)
    for _ in range(2):  # all accepted, but within the cooldown
        p.observe(_group_step(Arm("draft", 4), [4, 4]))
    assert p.k["x"] == 4
    p.observe(_group_step(Arm("draft", 4), [4, 4]))
    assert p.k["x"] == 5
    for _ in range(3):  # 0.6: inside the band, k holds
        p.observe(_group_step(Arm("draft", 5), [3, 3]))
    assert p.k["x"] == 5
    for _ in range(6):
        p.observe(_group_step(Arm("draft", 5), [0, 1]))
    assert p.k["x"] == 3  # two cooldowns, two steps down


def test_ema_and_heuristic_count_what_the_drafter_proposed():
    """n-gram lookup proposes fewer than k: a request that proposed 2 of 4 and kept both
    accepted everything it was offered. Rating it against k (the old rule: 0.5, the
    heuristic's "not all accepted") moved k down; against what was proposed it moves up.
    A step whose group proposed nothing (no match) is no evidence."""
    from adaptspec.control import EmaPolicy, HeuristicPolicy

    ema = EmaPolicy("ngram", PolicyConfig(("ngram",), 8), start_k=4, alpha=1.0, cooldown=1)
    ema.observe(_group_step(Arm("ngram", 4), [0], drafted=0))
    assert "x" not in ema.ema  # no candidates: nothing learned
    ema.observe(_group_step(Arm("ngram", 4), [2], drafted=2))
    assert ema.ema["x"] == 1.0 and ema.k["x"] == 5
    heur = HeuristicPolicy("ngram", PolicyConfig(("ngram",), 8), start_k=4)
    heur.observe(_group_step(Arm("ngram", 4), [0], drafted=0))
    assert heur.k.get("x", 4) == 4
    heur.observe(_group_step(Arm("ngram", 4), [2], drafted=2))
    assert heur.k["x"] == 6  # all that was proposed was kept: +2
    heur.observe(_group_step(Arm("ngram", 6), [1], drafted=2))
    assert heur.k["x"] == 5  # one of two kept: -1
    heur.observe(_group_step(Arm("ngram", 5), [5, 0], drafted=8))  # two requests, 8 of 10: who proposed what?
    assert heur.k["x"] == 5
    heur.observe(_group_step(Arm("ngram", 5), [5, 5, 1], drafted=15))  # all proposed in full: the majority rule
    assert heur.k["x"] == 7
