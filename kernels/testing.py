"""Helpers shared by the kernel tests and the bench: where the kernels run, ragged batches.

Without CUDA the kernels run in the Triton interpreter on CPU tensors. Triton chooses
interpreted or compiled when a ``@triton.jit`` function is defined, including its own
``tl.max``/``tl.sum`` at ``import triton`` (and it reads the variable again lazily), so
``load_kernels`` sets ``TRITON_INTERPRET=1`` for the rest of the process before it imports
triton (re-importing triton's Python modules when something imported it earlier); it only
affects triton, which nothing but these kernels runs on a machine without CUDA.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass

import torch


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    import triton.language as tl

    return isinstance(tl.max, InterpretedFunction)


def _forget_triton() -> None:
    """Drop triton's Python modules (and ours) so the next import re-decorates them; the
    compiled extension ``triton._C`` stays (it cannot be loaded twice)."""
    for name in list(sys.modules):
        if ((name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C")) \
                or name.startswith("adaptspec_kernels.triton_") or name == "adaptspec_kernels.verify":
            del sys.modules[name]


def load_kernels(device: str | None = None):
    """Import ``adaptspec_kernels.verify``; return ``(module, device)`` the kernels run on.

    ``device`` None: CUDA when available (compiled kernels), else the CPU (interpreter).
    When triton was already imported in compiled mode on a machine without CUDA (torch's
    ``_dynamo`` imports it whenever it is installed), its Python modules are imported again
    under the interpreter; nothing can run compiled kernels there anyway.
    """
    if device is None:
        interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
        device = "cuda" if torch.cuda.is_available() and not interpret else "cpu"
    if "triton" in sys.modules and device == "cuda" and _interpreted():
        device = "cpu"  # the process already chose the interpreter
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # stays set: triton also reads it lazily
        if "triton" in sys.modules and not _interpreted():
            _forget_triton()
    triton = importlib.import_module("triton")
    if device == "cpu" and _version(triton.__version__) < (3, 8):
        import numpy

        if _version(numpy.__version__) >= (2, 0):  # tested: 3.6.0 fails, 3.8.0 and 3.9.0 pass
            raise ImportError(f"the Triton {triton.__version__} interpreter cannot run these kernels "
                              f"with numpy {numpy.__version__} (int() of 1-element arrays); "
                              "use triton >= 3.8 for the CPU tests")
    importlib.import_module("adaptspec_kernels.triton_verify")
    return importlib.import_module("adaptspec_kernels.verify"), device


def load_kernels_or_skip():
    """``load_kernels()`` for test modules: a module-level pytest skip, with the reason, when
    triton is missing or cannot run the kernels here."""
    import pytest

    if not triton_installed():
        pytest.skip("triton not installed (pip install -e '.[triton]'): kernel tests skipped",
                    allow_module_level=True)
    try:
        return load_kernels()
    except ImportError as e:
        pytest.skip(f"Triton kernels cannot run here: {e}", allow_module_level=True)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@dataclass(slots=True)
class RaggedBatch:
    num_draft_tokens: torch.Tensor  # [num_reqs] int64
    target_logits: torch.Tensor  # [num_tokens, vocab_size]
    temperature: torch.Tensor  # [num_reqs] float32
    draft_probs: torch.Tensor  # [num_draft_tokens_total, vocab_size] q
    draft_token_ids: torch.Tensor  # [num_draft_tokens_total] int64, drawn from q
    uniform_accept: torch.Tensor  # [num_draft_tokens_total]
    uniform_sample: torch.Tensor  # [num_reqs]

    def target_rows_of_drafts(self) -> torch.Tensor:  # [num_draft_tokens_total] target row per draft row
        n = self.num_draft_tokens
        req = torch.repeat_interleave(torch.arange(n.numel(), device=n.device), n)
        return torch.arange(int(n.sum()), device=n.device) + req


def make_batch(
    num_draft_tokens: list[int],
    vocab_size: int,
    *,
    seed: int = 0,
    device: str = "cpu",
    logit_scale: float = 2.0,
    draft_noise: float = 0.5,
) -> RaggedBatch:
    """A random ragged batch whose draft distribution is a noisy copy of the target's
    (so that a fair share of drafted tokens is accepted)."""
    g = torch.Generator().manual_seed(seed)
    n = torch.tensor(num_draft_tokens, dtype=torch.int64)
    num_tokens, num_drafts = int((n + 1).sum()), int(n.sum())
    logits = torch.randn(num_tokens, vocab_size, generator=g) * logit_scale
    temperature = 0.5 + 1.5 * torch.rand(n.numel(), generator=g)
    batch = RaggedBatch(n, logits, temperature, torch.empty(0), torch.empty(0, dtype=torch.int64),
                        torch.rand(num_drafts, generator=g), torch.rand(n.numel(), generator=g))
    rows = batch.target_rows_of_drafts()
    draft_logits = logits[rows] + draft_noise * torch.randn(num_drafts, vocab_size, generator=g)
    batch.draft_probs = torch.softmax(draft_logits, -1)
    batch.draft_token_ids = (torch.multinomial(batch.draft_probs, 1, generator=g).squeeze(1)
                             if num_drafts else torch.empty(0, dtype=torch.int64))
    for name in ("num_draft_tokens", "target_logits", "temperature", "draft_probs", "draft_token_ids",
                 "uniform_accept", "uniform_sample"):
        setattr(batch, name, getattr(batch, name).to(device))
    return batch
