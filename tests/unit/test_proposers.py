"""The n-gram drafter on hand-built token sequences."""
from __future__ import annotations

import pytest

from adaptspec.engine.proposers import NgramProposer


def test_longest_suffix_latest_match():
    p = NgramProposer(max_n=3)
    # suffix [1, 2, 3] occurred at index 0 -> proposes what followed: 9, 8
    assert p.lookup([1, 2, 3, 9, 8, 5, 1, 2, 3], 2) == [9, 8]
    # the 3-gram [7, 1, 2] never occurred before; the 2-gram [1, 2] occurred at 0 and 4:
    # the latest (4) wins, followed by 6
    assert p.lookup([1, 2, 5, 0, 1, 2, 6, 7, 1, 2], 1) == [6]


def test_proposal_is_cut_at_the_end_and_at_k():
    p = NgramProposer(max_n=2)
    # [4, 5] occurred at 0; only [6, 4, 5] follows it before the suffix itself
    assert p.lookup([4, 5, 6, 4, 5], 8) == [6, 4, 5]
    assert p.lookup([4, 5, 6, 4, 5], 1) == [6]


def test_no_match_proposes_nothing():
    p = NgramProposer(max_n=3)
    assert p.lookup([1, 2, 3, 4], 4) == []
    assert p.lookup([7], 4) == []
    assert p.lookup([1, 1], 0) == []


def test_min_n_excludes_single_token_matches():
    # with min_n=2 the lone repeated token 5 is not a match
    assert NgramProposer(max_n=3, min_n=2).lookup([5, 9, 1, 5], 2) == []
    assert NgramProposer(max_n=3, min_n=1).lookup([5, 9, 1, 5], 2) == [9, 1]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(max_n=1, min_n=2)
