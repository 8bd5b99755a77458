"""Triton verification kernels against the pure-torch verifier, draw for draw.

Without CUDA the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set only while
the kernel module is imported: see adaptspec_kernels.testing). Vocabularies are small and
the vocabulary tile is 32 so every row spans several tiles, the last one partial.
"""
from __future__ import annotations

import pytest
import torch

from adaptspec.engine import verifier
from adaptspec.engine.sampling import logits_to_probs
from adaptspec_kernels.testing import load_kernels_or_skip, make_batch

kv, DEVICE = load_kernels_or_skip()  # imports triton (interpreted on a machine without CUDA)
BLOCK = 32  # vocabularies 37 / 100 / 130 are not multiples of it
RAGGED = [0, 3, 1, 4, 0, 2, 5, 1]


def _row_probs(batch):  # [num_tokens, vocab_size] the reference's processed target distributions
    temp_rows = torch.repeat_interleave(batch.temperature, batch.num_draft_tokens + 1)
    num_tokens = batch.target_logits.shape[0]
    return logits_to_probs(batch.target_logits, temp_rows,
                           torch.zeros(num_tokens, dtype=torch.long, device=DEVICE),
                           torch.ones(num_tokens, device=DEVICE))


def _assert_same(ref: verifier.VerifyResult, got: tuple[torch.Tensor, torch.Tensor]):
    assert torch.equal(got[0], ref.output_token_ids), (got[0], ref.output_token_ids)
    assert torch.equal(got[1], ref.num_accepted), (got[1], ref.num_accepted)


def _greedy_drafts(logits, n, reject_at):
    """Drafts that copy the target's argmax, then differ at position reject_at[b] (None: never)."""
    argmax = logits.argmax(-1)
    drafts, row = [], 0
    for b, k in enumerate(n.tolist()):
        for j in range(k):
            tok = int(argmax[row + j])
            drafts.append(tok if reject_at[b] is None or j < reject_at[b] else (tok + 1) % logits.shape[1])
        row += k + 1
    return torch.tensor(drafts, dtype=torch.int64, device=logits.device)


# --- greedy ---------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", [37, 100, 130])
def test_greedy_equals_reference_ragged(vocab):
    batch = make_batch(RAGGED, vocab, seed=vocab, device=DEVICE)
    n = batch.num_draft_tokens
    # rejection positions: none (bonus), first, middle, last; k = 0 rows get None
    reject_at = [None, 0, None, 2, None, 1, 4, 0]
    drafts = _greedy_drafts(batch.target_logits, n, reject_at)
    ref = verifier.verify_greedy(batch.target_logits, drafts, n)
    _assert_same(ref, kv.greedy_verify(batch.target_logits, drafts, n, block_size=BLOCK))
    # the hand-checkable part: accepted counts follow the rejection positions
    assert ref.num_accepted.tolist() == [0, 0, 1, 2, 0, 1, 4, 0]


def test_greedy_ties_take_the_first_index_across_tiles():
    # integer logits in {0, 1, 2}: many tied maxima, often in different tiles; torch.argmax
    # takes the first, so must the kernel
    g = torch.Generator().manual_seed(1)
    n = torch.tensor([2, 0, 3], device=DEVICE)
    logits = torch.randint(0, 3, (int((n + 1).sum()), 100), generator=g).float().to(DEVICE)
    drafts = _greedy_drafts(logits, n, [None, None, 1])
    _assert_same(verifier.verify_greedy(logits, drafts, n),
                 kv.greedy_verify(logits, drafts, n, block_size=BLOCK))


def test_greedy_edge_cases():
    g = torch.Generator().manual_seed(2)
    # all k = 0: only the bonus (the target's argmax) per request
    n0 = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    logits = torch.randn(3, 37, generator=g).to(DEVICE)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    got = kv.greedy_verify(logits, empty, n0, block_size=BLOCK)
    _assert_same(verifier.verify_greedy(logits, empty, n0), got)
    assert got[0].shape == (3, 1)
    # one request, all 4 accepted: 4 drafted + bonus
    n = torch.tensor([4], device=DEVICE)
    logits = torch.randn(5, 130, generator=g).to(DEVICE)
    drafts = _greedy_drafts(logits, n, [None])
    got = kv.greedy_verify(logits, drafts, n, block_size=BLOCK)
    _assert_same(verifier.verify_greedy(logits, drafts, n), got)
    assert got[1].tolist() == [4] and got[0][0, :4].tolist() == drafts.tolist()
    # first rejected: the recovered token is the target's argmax at row 0
    drafts = _greedy_drafts(logits, n, [0])
    got = kv.greedy_verify(logits, drafts, n, block_size=BLOCK)
    assert got[1].tolist() == [0] and got[0].tolist() == [[int(logits[0].argmax()), -1, -1, -1, -1]]
    # bf16 logits, the default tile (one partial tile)
    lb = logits.to(torch.bfloat16)
    _assert_same(verifier.verify_greedy(lb, drafts, n), kv.greedy_verify(lb, drafts, n))


# --- stochastic -------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", [37, 100, 130])
@pytest.mark.parametrize("one_hot", [False, True])
def test_stochastic_equals_reference_given_same_uniforms(vocab, one_hot):
    batch = make_batch(RAGGED, vocab, seed=10 + vocab, device=DEVICE)
    q = None if one_hot else batch.draft_probs
    probs = _row_probs(batch)
    args = (batch.draft_token_ids, q, batch.num_draft_tokens, batch.uniform_accept, batch.uniform_sample)
    ref = verifier.verify_stochastic(probs, *args)
    _assert_same(ref, kv.stochastic_verify(probs, *args, block_size=BLOCK))
    # temperature inside the kernel: raw logits + per-request temperature
    _assert_same(ref, kv.stochastic_verify_from_logits(batch.target_logits, batch.temperature, *args,
                                                       block_size=BLOCK))


def test_stochastic_many_seeds_mixed_outcomes():
    # 16 batches: accepted lengths cover 0..k, recovered and bonus tokens both occur
    seen = set()
    for seed in range(16):
        batch = make_batch([3, 0, 2, 5], 37, seed=seed, device=DEVICE, draft_noise=0.8)
        args = (batch.draft_token_ids, batch.draft_probs, batch.num_draft_tokens,
                batch.uniform_accept, batch.uniform_sample)
        ref = verifier.verify_stochastic(_row_probs(batch), *args)
        _assert_same(ref, kv.stochastic_verify_from_logits(batch.target_logits, batch.temperature, *args,
                                                           block_size=BLOCK))
        seen.update(zip(batch.num_draft_tokens.tolist(), ref.num_accepted.tolist()))
    assert {(5, 0), (5, 5), (3, 3), (0, 0)} <= seen


def test_stochastic_edge_cases():
    n = torch.tensor([3, 0, 2], device=DEVICE)
    vocab = 100
    batch = make_batch(n.tolist(), vocab, seed=3, device=DEVICE)
    probs = _row_probs(batch)
    rows = batch.target_rows_of_drafts()
    # q == p on every draft row: every drafted token is accepted (u * p < p), bonus from the last row
    q = probs[rows].clone()
    drafts = batch.draft_token_ids
    args = (drafts, q, n, batch.uniform_accept, batch.uniform_sample)
    got = kv.stochastic_verify(probs, *args, block_size=BLOCK)
    _assert_same(verifier.verify_stochastic(probs, *args), got)
    assert got[1].tolist() == [3, 0, 2]
    # first rejected: the first drafted token of each request has no target mass
    p0 = probs.clone()
    first = torch.tensor([0, 3], device=DEVICE)  # draft rows of the first drafted tokens
    p0[rows[first], drafts[first]] = 0.0
    args = (drafts, batch.draft_probs, n, batch.uniform_accept, batch.uniform_sample)
    got = kv.stochastic_verify(p0, *args, block_size=BLOCK)
    _assert_same(verifier.verify_stochastic(p0, *args), got)
    assert got[1].tolist() == [0, 0, 0]
    # an empty residual (q == p and the drafted token has q = p = 0): the reference falls back to p
    pz = probs.clone()
    pz[rows[first], drafts[first]] = 0.0
    qz = pz[rows].clone()
    args = (drafts, qz, n, batch.uniform_accept, batch.uniform_sample)
    _assert_same(verifier.verify_stochastic(pz, *args), kv.stochastic_verify(pz, *args, block_size=BLOCK))
    # extreme uniforms: u = 0 takes the first token with mass, u just below 1 the last one
    for u in (0.0, 1.0 - 2.0 ** -24):
        us = torch.full((3,), u, device=DEVICE)
        args = (drafts, batch.draft_probs, n, batch.uniform_accept, us)
        _assert_same(verifier.verify_stochastic(p0, *args), kv.stochastic_verify(p0, *args, block_size=BLOCK))
    # all k = 0: only bonus tokens
    n0 = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    p2, us = probs[:2], batch.uniform_sample[:2]
    empty_i, empty_f = torch.empty(0, dtype=torch.int64, device=DEVICE), torch.empty(0, device=DEVICE)
    for q in (None, torch.empty(0, vocab, device=DEVICE)):
        args = (empty_i, q, n0, empty_f, us)
        _assert_same(verifier.verify_stochastic(p2, *args), kv.stochastic_verify(p2, *args, block_size=BLOCK))


def test_stochastic_top_k_top_p_falls_back_to_torch_probs(monkeypatch):
    monkeypatch.setenv("ADAPTSPEC_VERIFIER", "torch")  # the reference side below
    batch = make_batch(RAGGED, 100, seed=5, device=DEVICE)
    num_reqs = len(RAGGED)
    top_k = torch.tensor([0, 5, 20, 0, 3, 0, 10, 1], device=DEVICE)
    top_p = torch.tensor([0.9, 1.0, 0.5, 1.0, 1.0, 0.8, 1.0, 1.0], device=DEVICE)
    args = (batch.draft_token_ids, batch.draft_probs, batch.num_draft_tokens, batch.uniform_accept,
            batch.uniform_sample)
    ref = verifier.verify_stochastic_from_logits_dispatch(batch.target_logits, batch.temperature, top_k, top_p,
                                                          *args)
    from adaptspec.engine.sampling import logits_to_probs

    got = kv.stochastic_verify_from_logits(batch.target_logits, batch.temperature, *args, top_k=top_k,
                                           top_p=top_p, probs_fn=logits_to_probs, block_size=BLOCK)
    _assert_same(ref, got)
    assert got[0].shape == (num_reqs, max(RAGGED) + 1)


# --- dispatch -------------------------------------------------------------------------------------

def test_select_backend(monkeypatch):
    monkeypatch.delenv("ADAPTSPEC_VERIFIER", raising=False)
    assert verifier.select_backend("cpu") == "torch"  # auto: the kernels only on CUDA
    monkeypatch.setenv("ADAPTSPEC_VERIFIER", "torch")
    assert verifier.select_backend("cuda") == "torch"
    monkeypatch.setenv("ADAPTSPEC_VERIFIER", "triton")
    assert verifier.select_backend("cpu") == "triton"
    monkeypatch.setenv("ADAPTSPEC_VERIFIER", "cuda")
    with pytest.raises(ValueError, match="ADAPTSPEC_VERIFIER"):
        verifier.select_backend()


def test_dispatch_routes_to_the_kernels(monkeypatch):
    batch = make_batch(RAGGED, 37, seed=7, device=DEVICE)
    probs = _row_probs(batch)
    n = batch.num_draft_tokens
    drafts = _greedy_drafts(batch.target_logits, n, [None, 1, None, 0, None, None, 2, 0])
    sargs = (batch.draft_token_ids, batch.draft_probs, n, batch.uniform_accept, batch.uniform_sample)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("ADAPTSPEC_VERIFIER", backend)
        results[backend] = (
            verifier.verify_greedy_dispatch(batch.target_logits, drafts, n, max_num_draft_tokens=max(RAGGED)),
            verifier.verify_stochastic_dispatch(probs, *sargs),
            verifier.verify_stochastic_from_logits_dispatch(batch.target_logits, batch.temperature, None, None,
                                                            *sargs),
        )
    for ref, got in zip(results["torch"], results["triton"]):
        assert isinstance(got, verifier.VerifyResult)
        _assert_same(ref, (got.output_token_ids, got.num_accepted))


def test_per_request_seeds_make_a_request_independent_of_its_batch():
    # the engine draws each request's uniforms from its own torch.Generator; the kernels hold
    # no random state, so a request's output depends only on its own seed and rows
    ks, seeds = [2, 4, 1], [11, 22, 33]
    batch = make_batch(ks, 100, seed=4, device=DEVICE)

    def uniforms(indices):
        ua, us = [], []
        for i in indices:
            g = torch.Generator().manual_seed(seeds[i])
            ua.append(torch.rand(ks[i], generator=g))
            us.append(torch.rand(1, generator=g))
        return torch.cat(ua).to(DEVICE), torch.cat(us).to(DEVICE)

    ua, us = uniforms([0, 1, 2])
    full = kv.stochastic_verify_from_logits(batch.target_logits, batch.temperature, batch.draft_token_ids,
                                            batch.draft_probs, batch.num_draft_tokens, ua, us, block_size=BLOCK)
    # request 1 alone: its target rows 3..7, draft rows 2..5
    ua1, us1 = uniforms([1])
    alone = kv.stochastic_verify_from_logits(batch.target_logits[3:8], batch.temperature[1:2],
                                             batch.draft_token_ids[2:6], batch.draft_probs[2:6],
                                             batch.num_draft_tokens[1:2], ua1, us1, block_size=BLOCK)
    assert torch.equal(alone[0][0], full[0][1]) and alone[1].item() == full[1][1].item()
