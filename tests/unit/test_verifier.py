"""Hand-built verification cases: each expected answer is worked out in the comment."""
from __future__ import annotations

import pytest
import torch

from adaptspec.engine.sampling import logits_to_probs, sample_from_probs
from adaptspec.engine.verifier import verify_greedy, verify_stochastic

V = 6


def onehot_logits(tokens):  # target argmax at each row
    x = torch.zeros(len(tokens), V)
    x[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return x


def test_greedy_ragged_batch():
    # req0: k=3, drafts [1,2,3], target argmax [1,2,4,5] -> accepts 1,2; rejects 3; recovered 4
    # req1: k=0, target argmax [0] -> plain decoding: emits 0
    # req2: k=2, drafts [3,3], target argmax [3,3,1] -> all accepted, bonus 1
    # req3: k=1, drafts [2], target argmax [5,5] -> first rejected, recovered 5
    logits = onehot_logits([1, 2, 4, 5] + [0] + [3, 3, 1] + [5, 5])
    drafts = torch.tensor([1, 2, 3, 3, 3, 2])
    res = verify_greedy(logits, drafts, torch.tensor([3, 0, 2, 1]))
    assert res.num_accepted.tolist() == [2, 0, 2, 0]
    assert res.output_token_ids.tolist() == [[1, 2, 4, -1], [0, -1, -1, -1], [3, 3, 1, -1], [5, -1, -1, -1]]


def test_greedy_all_k_zero():
    res = verify_greedy(onehot_logits([4, 2]), torch.zeros(0, dtype=torch.long), torch.tensor([0, 0]))
    assert res.output_token_ids.tolist() == [[4], [2]] and res.num_accepted.tolist() == [0, 0]


def test_stochastic_accepts_with_min_one_p_over_q():
    # one request, k=1, drafted token 2 with q(2)=0.5 and p(2)=0.25: accept iff u*0.5 < 0.25
    p = torch.tensor([[0.25, 0.25, 0.25, 0.25, 0, 0], [0, 0, 0, 0, 1.0, 0]])
    q = torch.tensor([[0.0, 0.0, 0.5, 0.5, 0, 0]])
    for u, expect_acc in ((0.49, 1), (0.51, 0)):
        res = verify_stochastic(p, torch.tensor([2]), q, torch.tensor([1]), torch.tensor([u]), torch.tensor([0.0]))
        assert res.num_accepted.tolist() == [expect_acc]
        if expect_acc:  # bonus from p's second row: token 4 for sure
            assert res.output_token_ids.tolist() == [[2, 4]]
        else:  # residual max(0, p - q) = [.25, .25, 0, 0, 0, 0] normalised; u=0 -> token 0
            assert res.output_token_ids.tolist() == [[0, -1]]


def test_stochastic_residual_never_samples_rejected_onehot_token():
    # n-gram draft (one-hot q) of token 1 with p(1) = 0.5: at rejection the residual is p
    # with token 1 removed, so no uniform can yield token 1
    p = torch.tensor([[0.5, 0.5, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]])
    for us in torch.linspace(0, 0.999, 20):
        res = verify_stochastic(p, torch.tensor([1]), None, torch.tensor([1]), torch.tensor([0.9]),
                                torch.tensor([float(us)]))
        assert res.output_token_ids.tolist() == [[0, -1]]


def test_stochastic_k0_row_samples_from_p():
    p = torch.tensor([[0.0, 0.0, 1.0, 0, 0, 0]])
    res = verify_stochastic(p, torch.zeros(0, dtype=torch.long), None, torch.tensor([0]),
                            torch.zeros(0), torch.tensor([0.7]))
    assert res.output_token_ids.tolist() == [[2]]


def test_top_k_top_p_and_temperature():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)
    p = logits_to_probs(logits, torch.tensor([1.0, 1.0, 1.0]), torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.7, 1.0]))
    assert (p[0, 2:] == 0).all() and torch.isclose(p[0].sum(), torch.tensor(1.0))
    # softmax([3,2,1,0]) = [.644, .237, .087, .032]: the first token alone is < 0.7, two reach it
    assert (p[1, 2:] == 0).all() and (p[1, :2] > 0).all()
    assert (p[2] > 0).all()
    hot = logits_to_probs(logits[:1], torch.tensor([0.05]), torch.tensor([0]), torch.tensor([1.0]))
    assert hot[0, 0] > 0.999


class _NoHostRead(torch.Tensor):
    """A tensor that fails on every read back to the host (on CUDA each one is a device sync)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__float__,
                    torch.Tensor.tolist, torch.Tensor.__index__):
            raise AssertionError(f"host read: {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


def _cut_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0])
    top_k = torch.tensor([0, 3, 0, 60, 1, 7])  # uncut rows, a k above the vocabulary, k = 1
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 1.0, 0.8])
    return logits, temperature, top_k, top_p


def test_host_hints_give_the_same_cuts_without_reading_the_device():
    """With the host-known largest top_k and whether any row cuts by top_p, the cuts equal
    the unhinted ones and read nothing back (a sync per step on CUDA); without the hints the
    same call reads (the negative control: the guard can fail)."""
    logits, temperature, top_k, top_p = _cut_rows()
    ref = logits_to_probs(logits, temperature, top_k, top_p)
    # the reference cut row by row, as the definition says
    for r in range(6):
        row = logits[r] / temperature[r]
        k = int(top_k[r])
        if k:
            row = row.masked_fill(row < row.topk(min(k, 50)).values[-1], float("-inf"))
        assert ((ref[r] > 0) <= torch.isfinite(row)).all()
    guarded = [x.as_subclass(_NoHostRead) for x in (logits, temperature, top_k, top_p)]
    hinted = logits_to_probs(*guarded, max_top_k=60, any_top_p=True)
    assert torch.equal(hinted.as_subclass(torch.Tensor), ref)
    with pytest.raises(AssertionError, match="host read"):
        logits_to_probs(*guarded)
    none = logits_to_probs(guarded[0], guarded[1], None, None)  # no request cuts: nothing to read either
    assert torch.allclose(none.as_subclass(torch.Tensor), torch.softmax(logits / temperature[:, None], -1))


def test_inverse_cdf_sampling_boundaries():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]] * 3)
    assert sample_from_probs(probs, torch.tensor([0.0, 0.4999, 0.5])).tolist() == [1, 1, 3]


def test_argmax_rows_matches_torch_with_ties_nan_and_inf():
    from adaptspec.engine.sampling import argmax_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (64, 300), generator=g).float()  # many ties: the first maximum wins
    x[3, 17] = float("nan")  # a NaN counts as the maximum, as in torch
    x[5] = float("-inf")
    x[6, :] = float("-inf")
    x[6, 250] = 0.0
    want = x.argmax(-1).tolist()
    assert argmax_rows(x) == want
    assert argmax_rows(x.bfloat16()) == x.bfloat16().argmax(-1).tolist()  # the torch path
    assert want[3] == 17 and want[6] == 250


def test_verify_greedy_host_equals_the_tensor_reference():
    from adaptspec.engine.verifier import verify_greedy_host

    g = torch.Generator().manual_seed(1)
    for trial in range(200):
        ks = torch.randint(0, 6, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)
        rows = int((ks + 1).sum())
        target = torch.randint(0, 3, (rows,), generator=g)  # small vocabulary: drafts often match
        drafts = torch.randint(0, 3, (int(ks.sum()),), generator=g)
        res = verify_greedy(onehot_logits(target.tolist()), drafts, ks)
        want = [row[:a + 1] for row, a in zip(res.output_token_ids.tolist(), res.num_accepted.tolist())]
        per_req, at = [], 0
        for k in ks.tolist():
            per_req.append(drafts[at:at + k].tolist())
            at += k
        assert verify_greedy_host(target.tolist(), per_req) == want, trial


def test_verify_greedy_host_rejects_a_row_count_mismatch():
    import pytest

    from adaptspec.engine.verifier import verify_greedy_host

    with pytest.raises(ValueError, match="target_argmax"):
        verify_greedy_host([1, 2, 3], [[1]])
