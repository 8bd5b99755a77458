"""Hand-built k = 2-3 cases for the REFERENCE verifier (``adaptspec.engine.verifier``).

The Triton kernel tests compare the kernels with these functions and are skipped without
triton, so the reference must be pinned down on its own: in particular where the bonus
token comes from when every one of k >= 2 drafts is accepted (the target row after the
last draft, ``k``), inside ragged batches whose largest k differs from the request's.
Each expected answer is worked out in the comment next to it.
"""
from __future__ import annotations

import torch

from adaptspec.engine.verifier import verify_greedy, verify_greedy_host, verify_stochastic

V = 8


def onehot(tokens):  # [len(tokens), V] distributions putting all mass on one token per row
    p = torch.zeros(len(tokens), V)
    p[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return p


def test_stochastic_bonus_comes_from_the_row_after_the_last_draft():
    # one request, k = 2, one-hot (n-gram) drafts [1, 2]; the target puts all its mass on
    # 1 at row 0 and on 2 at row 1, so both are accepted whatever u is (u * q = u < 1 = p).
    # The bonus is drawn from row 2, all mass on token 5: it must be 5. (Row 1 would give 2.)
    p = onehot([1, 2, 5])
    for u in (0.0, 0.5, 0.999):
        res = verify_stochastic(p, torch.tensor([1, 2]), None, torch.tensor([2]),
                                torch.tensor([u, u]), torch.tensor([u]))
        assert res.num_accepted.tolist() == [2]
        assert res.output_token_ids.tolist() == [[1, 2, 5]]


def test_stochastic_k3_bonus_with_a_spread_distribution_by_inverse_cdf():
    # k = 3, drafts [4, 4, 0] each with p = 1 at its row: all accepted. The bonus row 3 is
    # [0, .25, 0, .25, 0, 0, .5, 0]: CDF .25 (token 1), .5 (token 3), 1.0 (token 6), so
    # u = 0.1 -> 1, u = 0.3 -> 3, u = 0.9 -> 6. Row 2 (one-hot 0) would always give 0.
    bonus = torch.tensor([[0, .25, 0, .25, 0, 0, .5, 0]])
    p = torch.cat([onehot([4, 4, 0]), bonus])
    for u, want in ((0.1, 1), (0.3, 3), (0.9, 6)):
        res = verify_stochastic(p, torch.tensor([4, 4, 0]), None, torch.tensor([3]),
                                torch.full((3,), 0.5), torch.tensor([u]))
        assert res.num_accepted.tolist() == [3]
        assert res.output_token_ids.tolist() == [[4, 4, 0, want]]


def test_stochastic_ragged_batch_of_k_0_to_3():
    # req0: k=2, drafts [1, 2], rows one-hot [1, 2, 7]: all accepted, bonus 7 (from row 2)
    # req1: k=3, drafts [3, 3, 3], rows one-hot [3, 3, 6, 5]: the third draft (3) has p = 0
    #       at row 2 -> 2 accepted; residual at row 2 = p - one-hot(3) clipped = one-hot 6
    #       -> recovered 6 (the bonus row 3 is not used)
    # req2: k=0, row one-hot [4]: plain sampling, 4
    # req3: k=3, drafts [0, 1, 2], rows one-hot [0, 1, 2, 3]: all accepted, bonus 3 (row 3)
    # req4: k=1, draft [5], rows one-hot [5, 2]: accepted, bonus 2 (row 1)
    p = onehot([1, 2, 7] + [3, 3, 6, 5] + [4] + [0, 1, 2, 3] + [5, 2])
    drafts = torch.tensor([1, 2] + [3, 3, 3] + [0, 1, 2] + [5])
    k = torch.tensor([2, 3, 0, 3, 1])
    res = verify_stochastic(p, drafts, None, k, torch.full((9,), 0.3), torch.full((5,), 0.6))
    assert res.num_accepted.tolist() == [2, 2, 0, 3, 1]
    assert res.output_token_ids.tolist() == [[1, 2, 7, -1], [3, 3, 6, -1], [4, -1, -1, -1],
                                             [0, 1, 2, 3], [5, 2, -1, -1]]


def test_stochastic_k2_with_draft_probabilities():
    # k = 2 with a model draft q. Row 0: p = [.5 on 1, .5 on 2], q = [1 on 1]: accept 1 iff
    # u * 1 < .5. Row 1: p = [1 on 3], q = [.5 on 3, .5 on 4]: accept 3 iff u * .5 < 1 (always).
    # Row 2 (bonus): one-hot 6.
    p = torch.zeros(3, V)
    p[0, 1] = p[0, 2] = 0.5
    p[1, 3] = 1.0
    p[2, 6] = 1.0
    q = torch.zeros(2, V)
    q[0, 1] = 1.0
    q[1, 3] = q[1, 4] = 0.5
    drafts, k = torch.tensor([1, 3]), torch.tensor([2])
    # u0 = 0.4: accepted (0.4 < 0.5); u1 anything: accepted -> [1, 3] + bonus 6
    res = verify_stochastic(p, drafts, q, k, torch.tensor([0.4, 0.99]), torch.tensor([0.0]))
    assert res.num_accepted.tolist() == [2] and res.output_token_ids.tolist() == [[1, 3, 6]]
    # u0 = 0.6: rejected at position 0; residual max(0, p0 - q0) = [.5 on 2] -> recovered 2
    res = verify_stochastic(p, drafts, q, k, torch.tensor([0.6, 0.0]), torch.tensor([0.99]))
    assert res.num_accepted.tolist() == [0] and res.output_token_ids.tolist() == [[2, -1, -1]]


def test_stochastic_bonus_law_given_full_acceptance():
    """Over many draws, a fully accepted k = 2 step's bonus follows row 2 exactly (the law
    given full acceptance), not row 1: rows 1 and 2 have disjoint supports, so any draw
    from the wrong row is visible."""
    g = torch.Generator().manual_seed(0)
    n = 4000
    row0, row1 = onehot([3, 1])  # drafts 3 and 1 have p = 1 at their rows: always accepted
    row2 = torch.tensor([0, 0, 0, 0, 0.2, 0.3, 0.5, 0])
    p = torch.stack([row0, row1, row2] * n)
    res = verify_stochastic(p, torch.tensor([3, 1] * n), None, torch.full((n,), 2),
                            torch.rand(2 * n, generator=g), torch.rand(n, generator=g))
    assert (res.num_accepted == 2).all()
    counts = torch.bincount(res.output_token_ids[:, 2], minlength=V).double() / n
    assert counts[:4].sum() == 0 and counts[7] == 0
    assert torch.allclose(counts[4:7], row2[4:7].double(), atol=0.03)  # 4000 draws: sd < 0.008


def test_greedy_bonus_for_a_short_request_in_a_batch_with_a_longer_k():
    # req0: k=2, drafts [1, 2], argmax rows [1, 2, 6]: all accepted, bonus 6 (row 2, not
    #       the padding row a batch with max k = 3 would have at position 3)
    # req1: k=3, drafts [4, 4, 4], argmax rows [4, 4, 4, 0]: all accepted, bonus 0
    # req2: k=3, drafts [5, 6, 7], argmax rows [5, 6, 3, 2]: 2 accepted, recovered 3
    rows = [1, 2, 6] + [4, 4, 4, 0] + [5, 6, 3, 2]
    logits = onehot(rows) * 5.0
    drafts = [[1, 2], [4, 4, 4], [5, 6, 7]]
    res = verify_greedy(logits, torch.tensor(sum(drafts, [])), torch.tensor([2, 3, 3]))
    assert res.num_accepted.tolist() == [2, 3, 2]
    assert res.output_token_ids.tolist() == [[1, 2, 6, -1], [4, 4, 4, 0], [5, 6, 3, -1]]
    assert verify_greedy_host(rows, drafts) == [[1, 2, 6], [4, 4, 4, 0], [5, 6, 3]]
