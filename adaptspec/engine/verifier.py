"""Exact speculative verification over a flattened ragged batch (pure torch).

Each request ``b`` drafted ``num_draft_tokens[b]`` tokens (0 allowed); the target scored
``num_draft_tokens[b] + 1`` positions for it (its last emitted token, then each drafted
token). Rows are flattened request after request:

    target rows of b: cu_num_tokens[b] .. cu_num_tokens[b] + num_draft_tokens[b]
    draft rows of b:  cu_num_draft_tokens[b] .. + num_draft_tokens[b] - 1

The result per request is its **accepted** drafted tokens followed by one target token:
the **recovered** token at the first rejection, or the **bonus** token when all were
accepted. ``accepted length`` = accepted + 1 tokens emitted by the step.

Greedy (Leviathan et al. 2023, temperature 0): accept while the drafted token equals the
target's argmax; the target's argmax at the first mismatch (or after the last draft) is
emitted. Stochastic (Leviathan et al. 2023; Chen et al. 2023): accept drafted token x
with probability min(1, p(x) / q(x)); at the first rejection sample from
norm(max(0, p - q)); when all are accepted, sample the bonus token from the target's next
distribution. The output distribution is exactly the target's.

These two functions are the reference a fused (Triton) kernel is tested against; the
uniform draws are inputs so both can be compared draw for draw.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from adaptspec.engine.sampling import sample_from_probs


@dataclass(slots=True)
class VerifyResult:
    output_token_ids: torch.Tensor  # [num_reqs, max_k + 1] accepted + recovered/bonus, -1 padded
    num_accepted: torch.Tensor  # [num_reqs] accepted drafted tokens (accepted length - 1)


def _ragged_index(num_draft_tokens: torch.Tensor):
    """Padded [num_reqs, max_k + 1] row indices into the flattened target/draft rows."""
    dev = num_draft_tokens.device
    n = num_draft_tokens.long()
    max_k = int(n.max()) if n.numel() else 0
    cu_num_draft_tokens = torch.cumsum(n, 0) - n  # [num_reqs] start of each request's draft rows
    cu_num_tokens = cu_num_draft_tokens + torch.arange(n.numel(), device=dev)  # start of target rows
    j = torch.arange(max_k + 1, device=dev)[None, :]  # [1, max_k + 1]
    target_rows = cu_num_tokens[:, None] + j  # [num_reqs, max_k + 1]
    draft_rows = cu_num_draft_tokens[:, None] + j[:, :max_k]  # [num_reqs, max_k]
    draft_valid = j[:, :max_k] < n[:, None]  # [num_reqs, max_k]
    return max_k, target_rows, draft_rows, draft_valid, j


def verify_greedy(
    target_logits: torch.Tensor,  # [num_tokens, vocab_size], num_tokens = sum(num_draft_tokens + 1)
    draft_token_ids: torch.Tensor,  # [num_draft_tokens_total] int64
    num_draft_tokens: torch.Tensor,  # [num_reqs] int64
) -> VerifyResult:
    max_k, target_rows, draft_rows, draft_valid, j = _ragged_index(num_draft_tokens)
    target_argmax = target_logits.argmax(-1)  # [num_tokens]
    target_tok = target_argmax[target_rows.clamp(max=target_argmax.numel() - 1)]  # [num_reqs, max_k + 1]
    if max_k == 0:
        return VerifyResult(target_tok, torch.zeros_like(num_draft_tokens))
    drafted = draft_token_ids[draft_rows.clamp(max=max(draft_token_ids.numel() - 1, 0))]  # [num_reqs, max_k]
    match = (drafted == target_tok[:, :max_k]) & draft_valid
    num_accepted = match.long().cumprod(1).sum(1)  # [num_reqs]
    # positions < num_accepted hold the drafted (== target) tokens; num_accepted holds the
    # target's own token there: recovered on a mismatch, bonus after the last draft
    out = torch.where(j <= num_accepted[:, None], target_tok, torch.full_like(target_tok, -1))
    return VerifyResult(out, num_accepted)


def verify_greedy_host(target_argmax: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """``verify_greedy`` on the host, from the target's argmax at every row (``argmax_rows``
    of the flattened logits) and each request's drafted tokens: per request its accepted
    tokens and the recovered or bonus one. The CPU engine's greedy path (no tensors: at batch
    1 the tensor version's dozen small ops cost more than the comparison); tested equal to
    ``verify_greedy``."""
    out, row = [], 0
    for d in drafts:
        t = target_argmax[row:row + len(d) + 1]
        a = 0
        while a < len(d) and d[a] == t[a]:
            a += 1
        out.append(t[:a + 1])
        row += len(d) + 1
    if row != len(target_argmax):
        raise ValueError(f"target_argmax: {len(target_argmax)} rows for drafts needing {row}")
    return out


def verify_stochastic(
    target_probs: torch.Tensor,  # [num_tokens, vocab_size] processed target distributions p
    draft_token_ids: torch.Tensor,  # [num_draft_tokens_total] int64
    draft_probs: torch.Tensor | None,  # [num_draft_tokens_total, vocab_size] q; None: one-hot drafts
    num_draft_tokens: torch.Tensor,  # [num_reqs] int64
    uniform_accept: torch.Tensor,  # [num_draft_tokens_total] in [0, 1)
    uniform_sample: torch.Tensor,  # [num_reqs] in [0, 1): the recovered/bonus draw
) -> VerifyResult:
    max_k, target_rows, draft_rows, draft_valid, j = _ragged_index(num_draft_tokens)
    num_reqs = num_draft_tokens.numel()
    if max_k > 0:
        drow = draft_rows.clamp(max=max(draft_token_ids.numel() - 1, 0))
        drafted = draft_token_ids[drow]  # [num_reqs, max_k]
        p_tok = target_probs[target_rows[:, :max_k].clamp(max=target_probs.shape[0] - 1), drafted]
        q_tok = torch.ones_like(p_tok) if draft_probs is None else draft_probs[drow, drafted]
        accept = (uniform_accept[drow] * q_tok < p_tok) & draft_valid  # u < p/q, i.e. prob min(1, p/q)
        num_accepted = accept.long().cumprod(1).sum(1)  # [num_reqs]
    else:
        drafted = torch.empty(num_reqs, 0, dtype=torch.long, device=num_draft_tokens.device)
        num_accepted = torch.zeros_like(num_draft_tokens)
    # the distribution the extra token comes from: residual at the first rejection, else p
    final_rows = target_rows.gather(1, num_accepted[:, None]).squeeze(1)  # [num_reqs]
    p_final = target_probs[final_rows]  # [num_reqs, vocab_size]
    rejected = num_accepted < num_draft_tokens  # [num_reqs]
    if bool(rejected.any()):
        rej_draft_row = (draft_rows.gather(1, num_accepted.clamp(max=max(max_k - 1, 0))[:, None]).squeeze(1)
                         if max_k > 0 else num_accepted)
        rej_draft_row = rej_draft_row.clamp(max=max(draft_token_ids.numel() - 1, 0))
        if draft_probs is None:
            q_final = torch.zeros_like(p_final).scatter_(1, draft_token_ids[rej_draft_row][:, None], 1.0)
        else:
            q_final = draft_probs[rej_draft_row]
        residual = (p_final - q_final).clamp(min=0.0)
        # p == q leaves no residual mass; a rejection is then impossible, keep p for safety
        has_mass = residual.sum(-1, keepdim=True) > 0
        residual = torch.where(has_mass, residual, p_final)
        p_final = torch.where(rejected[:, None], residual, p_final)
    extra = sample_from_probs(p_final, uniform_sample)  # [num_reqs]: recovered or bonus
    out = torch.full((num_reqs, max_k + 1), -1, dtype=torch.long, device=num_draft_tokens.device)
    if max_k > 0:
        out[:, :max_k] = torch.where(j[:, :max_k] < num_accepted[:, None], drafted, out[:, :max_k])
    out.scatter_(1, num_accepted[:, None], extra[:, None])
    return VerifyResult(out, num_accepted)


# --- backend dispatch (issue 6): Triton kernels (adaptspec_kernels) on CUDA, torch otherwise.
# Same signatures and results as the functions above; triton is imported only when selected.

def _triton_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def select_backend(device: torch.device | str | None = None, choice: str | None = None) -> str:
    """``"triton"`` or ``"torch"`` for ``choice`` (auto | torch | triton; None: the env var
    ADAPTSPEC_VERIFIER, read here, once, by whoever builds an engine).

    auto (the default): triton when ``device`` is CUDA (no device: when CUDA is available)
    and triton is installed. triton forces the kernels (on CPU tensors they then need
    TRITON_INTERPRET=1, as the tests set); torch forces this module's reference.
    """
    import os

    if choice is None or choice == "auto":
        choice = os.environ.get("ADAPTSPEC_VERIFIER", "auto")
    choice = choice.strip().lower() or "auto"
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"ADAPTSPEC_VERIFIER={choice!r}: expected one of auto, torch, triton")
    if choice == "torch":
        return "torch"
    if choice == "triton":
        if not _triton_importable():
            raise RuntimeError("ADAPTSPEC_VERIFIER=triton but triton is not installed "
                               "(pip install -e '.[triton]')")
        return "triton"
    on_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    return "triton" if on_cuda and _triton_importable() else "torch"


def verify_greedy_dispatch(
    target_logits: torch.Tensor,  # [num_tokens, vocab_size]
    draft_token_ids: torch.Tensor,  # [num_draft_tokens_total] int64
    num_draft_tokens: torch.Tensor,  # [num_reqs] int64
    *,
    max_num_draft_tokens: int | None = None,  # host-known max k: saves the kernels' one sync
    backend: str | None = None,  # "torch" | "triton": chosen once by the caller; None: select_backend
) -> VerifyResult:
    if (backend or select_backend(target_logits.device)) == "torch":
        return verify_greedy(target_logits, draft_token_ids, num_draft_tokens)
    from adaptspec_kernels.verify import greedy_verify

    return VerifyResult(*greedy_verify(target_logits, draft_token_ids, num_draft_tokens,
                                       max_num_draft_tokens=max_num_draft_tokens))


def verify_stochastic_dispatch(
    target_probs: torch.Tensor,  # [num_tokens, vocab_size] processed target distributions p
    draft_token_ids: torch.Tensor,  # [num_draft_tokens_total] int64
    draft_probs: torch.Tensor | None,  # [num_draft_tokens_total, vocab_size] q; None: one-hot drafts
    num_draft_tokens: torch.Tensor,  # [num_reqs] int64
    uniform_accept: torch.Tensor,  # [num_draft_tokens_total] in [0, 1)
    uniform_sample: torch.Tensor,  # [num_reqs] in [0, 1)
    *,
    max_num_draft_tokens: int | None = None,  # host-known max k: saves the kernels' one sync
    backend: str | None = None,
) -> VerifyResult:
    args = (target_probs, draft_token_ids, draft_probs, num_draft_tokens, uniform_accept, uniform_sample)
    if (backend or select_backend(target_probs.device)) == "torch":
        return verify_stochastic(*args)
    from adaptspec_kernels.verify import stochastic_verify

    return VerifyResult(*stochastic_verify(*args, max_num_draft_tokens=max_num_draft_tokens))


def verify_stochastic_from_logits_dispatch(
    target_logits: torch.Tensor,  # [num_tokens, vocab_size] raw target logits
    temperature: torch.Tensor,  # [num_reqs] float, > 0
    top_k: torch.Tensor | None,  # [num_reqs] int, 0 = no cut; None: no request cuts
    top_p: torch.Tensor | None,  # [num_reqs] float in (0, 1]; None: no request cuts
    draft_token_ids: torch.Tensor,  # [num_draft_tokens_total] int64
    draft_probs: torch.Tensor | None,  # [num_draft_tokens_total, vocab_size] q; None: one-hot drafts
    num_draft_tokens: torch.Tensor,  # [num_reqs] int64
    uniform_accept: torch.Tensor,  # [num_draft_tokens_total] in [0, 1)
    uniform_sample: torch.Tensor,  # [num_reqs] in [0, 1)
    *,
    max_num_draft_tokens: int | None = None,  # host-known max k: saves the kernels' one sync
    max_top_k: int | None = None,  # host-known largest top_k (the cuts then read nothing back)
    backend: str | None = None,
) -> VerifyResult:
    """Per-request temperature/top-k/top-p applied to the target logits, then verified; the
    Triton path fuses the temperature softmax (top-k/top-p still go through torch). With
    ``max_top_k`` given the cuts need no device sync (a ``top_p`` of None: no request cuts)."""
    from functools import partial

    from adaptspec.engine.sampling import logits_to_probs

    # the host's hints (None: the cuts read the tensors); a None tensor means no request cuts
    hints = {} if max_top_k is None else {"max_top_k": max_top_k if top_k is not None else 0,
                                          "any_top_p": top_p is not None}
    probs_fn = partial(logits_to_probs, **hints)
    if (backend or select_backend(target_logits.device)) == "triton":
        from adaptspec_kernels.verify import stochastic_verify_from_logits

        return VerifyResult(*stochastic_verify_from_logits(
            target_logits, temperature, draft_token_ids, draft_probs, num_draft_tokens,
            uniform_accept, uniform_sample, top_k=top_k, top_p=top_p, probs_fn=probs_fn,
            max_num_draft_tokens=max_num_draft_tokens))

    dev, num_reqs = target_logits.device, num_draft_tokens.numel()
    rows = num_draft_tokens.to(dev).long() + 1  # target rows per request

    def per_row(x: torch.Tensor | None, fill) -> torch.Tensor:  # [num_reqs] -> [num_tokens]
        x = torch.full((num_reqs,), fill, device=dev) if x is None else x.to(dev)
        return torch.repeat_interleave(x, rows, output_size=target_logits.shape[0])

    probs = probs_fn(target_logits, per_row(temperature, 1.0), None if top_k is None else per_row(top_k, 0),
                     None if top_p is None else per_row(top_p, 1.0))
    return verify_stochastic(probs, draft_token_ids, draft_probs, num_draft_tokens, uniform_accept, uniform_sample)
