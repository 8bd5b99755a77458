"""The CPU kernels: build them once, pack weights, call them.

Two C files, one shared library:

- ``csrc/small_gemm.c``, the small-M matmul ``LlamaModel`` uses on the CPU for the few-row
  products of decoding and verification (see the C file for why);
- ``csrc/layer_ops.c``, the rest of a decoder layer for those steps (residual add +
  RMSNorm, SwiGLU, and attention with the rotary embedding and the KV-cache write), in
  fp32. Used for fp32 compute on the CPU whatever the matmul (bf16 models compute in fp32
  on the kernel; fp32 models too). With every weight packed for the kernel, ``CLayers``
  runs the loop over all layers in one call (``adaptspec_layers``;
  ``ADAPTSPEC_CPU_LAYER_LOOP=python`` to turn it off).

The library is compiled on first use with the system C compiler (``$CC`` or ``cc``; ``-O3
-march=native -fopenmp``, about two seconds) into ``$ADAPTSPEC_HOME/ext``, keyed by the
sources, the compiler and the CPU, and checked against torch on small inputs before it is
used. Without a compiler, on a failed build or check, or with ``ADAPTSPEC_CPU_KERNEL=0``,
everything falls back to torch (``status()`` says why). ctypes releases the GIL around
each call, so a step spends most of its time without it (the service's event loop runs
meanwhile).

Where it is used (``default_matmul``): bfloat16 and float32 models on the CPU (``mode``),
bf16 computed in fp32 around the products (pairs or widened, below; see ``LlamaModel``).
fp32: 1 to ``MAX_ROWS_F32`` rows (decoding, verifying k + 1 candidates, a batch) on the
kernel, where a BLAS GEMM packs panels and streams the weights slower from 2 rows on;
single products of more rows (the Python layer loop's, when a draft head wants the target's
features) on the BLAS, so packed fp32 weights also keep a copy as torch has it (twice the
fp32 weight memory). A whole step in the C layer loop (``CLayers``) stays on the kernel at
any row count: faster there than the Python loop with the BLAS's products. One row is the
kernel's too by default: it makes a row's result independent of the other rows, so a token
decoded alone and the same token verified among k + 1 candidates get bitwise the same
logits; on some CPUs the BLAS's matrix-vector path is the faster one, and
``ADAPTSPEC_CPU_ONE_ROW=blas`` sends one-row products there. ``ADAPTSPEC_CPU_KERNEL=bf16`` keeps fp32 matmuls on torch,
``ADAPTSPEC_CPU_KERNEL=0`` turns the C kernels off.

bf16 on CPUs with AVX512_BF16 (``bf16_pairs()``; ``ADAPTSPEC_CPU_BF16_DOT=0`` turns it off):
weights packed in pairs of input rows and the inputs rounded to bf16, one VDPBF16PS per 32
multiply-adds (``csrc/small_gemm.c``): half the arithmetic per weight and row of the
widened layout. The packed weights of a model live in one buffer on transparent huge pages
(``into_huge_pages``).

Measured timings of these choices: docs/benchmarks.md ("Kernel and forward timings").
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

BW = 32  # output columns per packed block (two 16-float vectors on AVX-512, four 8-float on AVX2)
# Rows past which torch takes over, measured for a 576 x 3072 layer on this project's 2-core
# machine: fp32 kernel / BLAS 0.47 / 0.59 ms at 5 rows, 1.7 / 2.0 at 64, 3.7 / 3.1 at 150;
# bf16 0.41 / 1.2 ms at 5 rows, 4.0 / 9.3 at 150, 6.5 / 15.4 at 256.
MAX_ROWS_F32 = 64
# bf16 has no such cap: without AVX512-BF16 torch's bf16 GEMM is the slow one at every size
# (576 x 3072 bf16 weight, 600 / 1600 rows: kernel 9.0 / 26.6 ms, torch 58.5 / 168 ms), and
# batched prefills of long prompts pass 512 rows.

def _one_row_on_blas() -> bool:
    """``ADAPTSPEC_CPU_ONE_ROW``: "kernel" (the default) or "blas": where one-row fp32
    products (decoding one token per sequence) go. Read once, at import."""
    v = os.environ.get("ADAPTSPEC_CPU_ONE_ROW", "kernel").lower()
    if v not in ("kernel", "blas"):
        raise ValueError(f"ADAPTSPEC_CPU_ONE_ROW={v!r}: use kernel or blas")
    return v == "blas"


ONE_ROW_BLAS = _one_row_on_blas()


def _bf16_dot_wanted() -> bool:
    """``ADAPTSPEC_CPU_BF16_DOT``: "auto" (the default: bf16 weights in the pair layout, x
    rounded to bf16 and VDPBF16PS, where the CPU has AVX512_BF16) or "0" (bf16 weights widened
    to fp32 and multiplied by fp32 x, on every CPU). Read once, at import."""
    v = os.environ.get("ADAPTSPEC_CPU_BF16_DOT", "auto").lower()
    if v not in ("auto", "1", "on", "0", "off"):
        raise ValueError(f"ADAPTSPEC_CPU_BF16_DOT={v!r}: use auto or 0")
    return v in ("auto", "1", "on")


BF16_DOT = _bf16_dot_wanted()  # pack() packs bf16 weights in pairs when this and the CPU allow


def _layer_loop() -> str:
    """``ADAPTSPEC_CPU_LAYER_LOOP``: "c" (the default: a decode or verification step's decoder
    layers in one C call, ``CLayers``) or "python" (one call per norm, product and attention,
    as before; the same results bitwise). Read once, at import."""
    v = os.environ.get("ADAPTSPEC_CPU_LAYER_LOOP", "c").lower()
    if v not in ("c", "python"):
        raise ValueError(f"ADAPTSPEC_CPU_LAYER_LOOP={v!r}: use c or python")
    return v


LAYER_LOOP = _layer_loop()
_pairs_built = False  # the library has the pair kernel (AVX512_BF16 at build time)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_status = "not loaded"
_tried = False


SOURCES = ("small_gemm.c", "layer_ops.c")  # one shared library


def _sources() -> dict[str, str]:
    d = resources.files("adaptspec.models").joinpath("csrc")
    return {name: d.joinpath(name).read_text() for name in SOURCES}


def _cpu_id() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(cc: str, out: Path, srcs: dict[str, str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        files = []
        for name, text in srcs.items():
            files.append(Path(tmp) / name)
            files[-1].write_text(text)
        so = Path(tmp) / out.name
        cmd = [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", *map(str, files), "-o", str(so), "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:6])} failed: {(r.stderr or r.stdout).strip()[:300]}")
        os.replace(so, out)  # atomic: concurrent builders (Ray workers) never see half a file


def _load() -> None:
    global _lib, _status
    if mode() == "0":
        _status = "off (ADAPTSPEC_CPU_KERNEL=0)"
        return
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        _status = "no C compiler (cc/gcc) on PATH: torch matmul"
        return
    srcs = _sources()
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as e:
        _status = f"C compiler {cc} unusable ({e}): torch matmul"
        return
    key = hashlib.sha256("\n".join([*srcs.values(), cc, *ver, _cpu_id()]).encode()).hexdigest()[:16]
    from adaptspec.models.registry import home

    out = home() / "ext" / f"small_gemm-{key}{'.dll' if os.name == 'nt' else '.so'}"
    try:
        if not out.exists():
            _build(cc, out, srcs)
        lib = ctypes.CDLL(str(out))
        f = lib.adaptspec_small_gemm
        f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                      ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        f.restype = None
        _declare_layer_ops(lib)
        lib.adaptspec_bf16_pairs.restype = ctypes.c_int
        pairs = bool(lib.adaptspec_bf16_pairs())
        lanes, tile = lib.adaptspec_small_gemm_lanes(), lib.adaptspec_small_gemm_tile_rows()
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _status = f"build/load failed ({e}): torch matmul"
        return
    global _pairs_built
    _lib, _pairs_built = lib, pairs
    bad = _self_check()
    if bad:
        _lib, _pairs_built = None, False
        _status = f"self-check failed ({bad}): torch matmul"
        return
    _status = (f"on ({out.name}, {lanes}-float vectors, tiles of {tile} rows"
               f"{', bf16 dot products' if _pairs_built and BF16_DOT else ''})")


def _declare_layer_ops(lib: ctypes.CDLL) -> None:
    i, p, f, i64 = ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_int64
    for name, args in (("adaptspec_add_rms_norm", [i, i, p, p, p, f, p]),
                       ("adaptspec_silu_mul", [i, i, p, p]),
                       ("adaptspec_attention", [i, p, p, i, i, p, p, i, p, p, p, p, i64, i64, i, i, i, f, p, i, i]),
                       ("adaptspec_layers", [i, i, i, i, i, p, f, p, p, p, p, p, p, p, i, p, p,
                                             i, p, p, i, i, p, p, p, p, p, i64, i64, i, i, i, f, i,
                                             p, p, p, p, p, p, p, i])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None


def _self_check() -> str:
    g = torch.Generator().manual_seed(0)
    for dt, pairs in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        if pairs and not _pairs_built:
            continue
        for m, i, o in ((1, 40, 70), (5, 64, 96), (11, 33, 32)):
            w = torch.randn(i, o, generator=g).to(dt)
            x = torch.randn(m, i, generator=g).to(dt)
            want = x.float() @ w.float()
            got = matmul(x, pack(w, pairs=pairs)).float()  # rounded to bf16 for bf16 inputs
            err = (got - want).abs().max().item()
            tol = 1e-4 if dt == torch.float32 else 2.0 ** -7
            if not err <= tol * max(1.0, want.abs().max().item()):
                return f"{dt} {m}x{i}x{o}: max error {err:.3g}"
    return _check_layer_ops(g)


def _check_layer_ops(g: torch.Generator) -> str:
    """Norm and SwiGLU against torch on small shapes (attention is checked against the torch
    forward by tests/unit/test_llama_forward.py)."""
    import torch.nn.functional as F

    h, d, w = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g), torch.randn(40, generator=g)
    want = F.rms_norm(h + d, (40,), w, 1e-5)
    got = add_rms_norm(h.clone(), d, w, 1e-5)
    if not (got - want).abs().max().item() <= 1e-5:
        return "add_rms_norm differs from torch"
    gu = torch.randn(3, 2 * 37, generator=g) * 4
    if not (silu_mul(gu) - F.silu(gu[:, :37]) * gu[:, 37:]).abs().max().item() <= 1e-5:
        return "silu_mul differs from torch"
    return ""


# ---- the rest of a decoder layer (csrc/layer_ops.c), fp32, for rows of a few tokens -------
# LlamaModel._forward_fused calls these; the tensors must be contiguous fp32 on the CPU.

def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``h += delta`` (in place, when given), then RMSNorm(h) * w. h, delta: [N, H]."""
    n, hid = h.shape
    out = torch.empty_like(h) if out is None else out
    _lib.adaptspec_add_rms_norm(n, hid, h.data_ptr(), None if delta is None else delta.data_ptr(),
                                w.data_ptr(), eps, out.data_ptr())
    return out


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """SwiGLU of the fused gate/up product gu [N, 2I]: silu(gate) * up, [N, I]."""
    n, two_i = gu.shape
    out = torch.empty(n, two_i // 2, dtype=torch.float32)
    _lib.adaptspec_silu_mul(n, two_i // 2, gu.data_ptr(), out.data_ptr())
    return out


def attention(qkv: torch.Tensor, row_start: torch.Tensor, block_tables: torch.Tensor, cache_lens: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              num_heads: int, max_ctx: int) -> torch.Tensor:
    """Rotary embedding, paged-cache write and causal attention over the cache for B
    sequences' new tokens (see ``adaptspec_attention``). qkv [N, (H + 2 Hkv) D] (rotated in
    place); row_start [B + 1], block_tables [B, max_blocks], cache_lens [B]: int32, contiguous;
    caches [num_blocks, Hkv, block_size, D]. Returns [N, H * D]."""
    _, hkv, bs, d = k_cache.shape
    n = qkv.shape[0]
    out = torch.empty(n, num_heads * d, dtype=torch.float32)
    _lib.adaptspec_attention(block_tables.shape[0], row_start.data_ptr(), block_tables.data_ptr(),
                             block_tables.shape[1], bs, cache_lens.data_ptr(),
                             qkv.data_ptr(), qkv.shape[1], cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                             v_cache.data_ptr(), hkv * bs * d, bs * d, num_heads, hkv, d,
                             d ** -0.5, out.data_ptr(), max_ctx, torch.get_num_threads())
    return out


def mode() -> str:
    """``ADAPTSPEC_CPU_KERNEL``: "all" (the default: the matmul kernel for bf16 and fp32
    models, the layer ops for every fp32-compute model), "bf16" (the matmul kernel for bf16
    models only; fp32 matmuls on torch) or "0" (no C kernels: torch everywhere)."""
    v = os.environ.get("ADAPTSPEC_CPU_KERNEL", "all").lower()
    if v in ("0", "off", "false", "no"):
        return "0"
    if v in ("all", "fp32", "float32", "1", "on", "true", "yes"):
        return "all"
    if v in ("bf16", "bfloat16"):
        return "bf16"
    raise ValueError(f"ADAPTSPEC_CPU_KERNEL={v!r}: use all, bf16 or 0")


def default_matmul(dtype: torch.dtype, device: torch.device) -> str:
    """The ``LlamaModel`` matmul mode for a model: "packed" where the kernel is used (see
    the module docstring), "fast" elsewhere on the CPU, "reference" off the CPU."""
    if device.type != "cpu":
        return "reference"
    m = mode()
    wanted = m == "all" or (m == "bf16" and dtype == torch.bfloat16)
    return "packed" if wanted and enabled() else "fast"


class CLayers:
    """A model's decoder layers as the pointer arrays ``adaptspec_layers`` takes (built once;
    the KV caches' pointers by ``set_caches`` whenever they are allocated). None of the
    tensors move afterwards: the model keeps them."""

    def __init__(self, layers: list[tuple], norm: torch.Tensor):
        L = len(layers)
        arr = lambda xs: (ctypes.c_void_p * L)(*xs)  # noqa: E731
        self.num_layers = L
        self.ln1 = arr([lay[0].data_ptr() for lay in layers])
        self.wqkv = arr([lay[1].blocks.data_ptr() for lay in layers])
        self.bias = arr([lay[2].data_ptr() for lay in layers]) if layers[0][2] is not None else None
        self.wo = arr([lay[3].blocks.data_ptr() for lay in layers])
        self.ln2 = arr([lay[4].data_ptr() for lay in layers])
        self.wgu = arr([lay[5].blocks.data_ptr() for lay in layers])
        self.wdown = arr([lay[6].blocks.data_ptr() for lay in layers])
        w = layers[0][1]
        self.layout = w.layout
        self.hidden, self.wqkv_out = w.in_features, w.out_features
        self.attn_width = layers[0][3].in_features
        self.inter = layers[0][6].in_features
        self.norm = norm
        self.kcache = self.vcache = None

    @staticmethod
    def applies(layers: list[tuple]) -> bool:
        """Every weight packed alike (one layout), the same sizes in every layer, every norm
        fp32: what the C loop needs."""
        if LAYER_LOOP != "c" or _lib is None or not layers:
            return False
        ws = [w for lay in layers for w in (lay[1], lay[3], lay[5], lay[6])]
        if not all(isinstance(w, PackedWeight) for w in ws):
            return False
        if len({w.layout for w in ws}) != 1 or (ws[0].pairs and not _pairs_built):
            return False
        shapes = {tuple((w.in_features, w.out_features) for w in (lay[1], lay[3], lay[5], lay[6])) for lay in layers}
        if len(shapes) != 1:  # the C loop takes layer 0's sizes for every layer
            return False
        return all(lay[0].dtype == torch.float32 and lay[4].dtype == torch.float32 for lay in layers)

    def set_caches(self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]) -> None:
        L = self.num_layers
        self.kcache = (ctypes.c_void_p * L)(*[t.data_ptr() for t in k_cache])
        self.vcache = (ctypes.c_void_p * L)(*[t.data_ptr() for t in v_cache])
        _, self.hkv, self.block_size, self.head_dim = k_cache[0].shape

    def takes(self, n: int) -> bool:
        """Whether an ``n``-row step runs here: any number of rows, but fp32's one row with
        ONE_ROW_BLAS (the Python loop sends it to the BLAS). Past MAX_ROWS_F32 rows the BLAS
        is the faster product one at a time, but the whole step is faster here, by a third or
        more just past the threshold (one C call for the layers against a Python loop of
        products, norms and attention; ``docs/benchmarks.md``), and a row's result stays
        independent of the others at every row count."""
        if self.kcache is None or n < 1:
            return False
        return self.layout != 0 or not (n == 1 and ONE_ROW_BLAS)

    def run(self, h: torch.Tensor, eps: float, row_start: torch.Tensor, block_tables: torch.Tensor,
            cache_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
            max_ctx: int) -> torch.Tensor:
        """All layers and the final norm over h [N, hidden] (updated in place): the hidden
        states [N, hidden] that ``LlamaModel._forward_fused``'s loop would return."""
        n, hd = h.shape
        widths = [hd, self.wqkv_out, self.attn_width, hd, 2 * self.inter, self.inter, hd]
        scratch = torch.empty(n * sum(widths), dtype=torch.float32)
        ptrs, at = [], scratch.data_ptr()
        for wd in widths:
            ptrs.append(at)
            at += n * wd * 4
        out = torch.empty(n, hd, dtype=torch.float32)
        d = self.head_dim
        _lib.adaptspec_layers(self.num_layers, n, hd, self.wqkv_out, self.inter, h.data_ptr(), eps,
                              self.ln1, self.wqkv, self.bias, self.wo, self.ln2, self.wgu, self.wdown,
                              self.layout, self.norm.data_ptr(), out.data_ptr(),
                              block_tables.shape[0], row_start.data_ptr(), block_tables.data_ptr(),
                              block_tables.shape[1], self.block_size, cache_lens.data_ptr(),
                              cos.data_ptr(), sin.data_ptr(), self.kcache, self.vcache,
                              self.hkv * self.block_size * d, self.block_size * d, num_heads, self.hkv, d, d ** -0.5,
                              max_ctx, *ptrs, torch.get_num_threads())
        return out


def enabled() -> bool:
    """Load (build on first use) and say whether the kernel is in use."""
    global _tried
    if not _tried:
        with _lock:
            if not _tried:
                _load()
                _tried = True
    return _lib is not None


def status() -> str:
    enabled()
    return _status


def vector_lanes() -> int:
    """Floats per vector the kernel was built for (16 AVX-512, 8 AVX2, 4 NEON / SSE); 0: not in use."""
    return int(_lib.adaptspec_small_gemm_lanes()) if enabled() else 0


def bf16_pairs() -> bool:
    """Whether ``pack`` puts bf16 weights in the pair layout (x rounded to bf16, VDPBF16PS):
    the kernel is in use, was built with AVX512_BF16, and ``ADAPTSPEC_CPU_BF16_DOT`` allows."""
    return BF16_DOT and enabled() and _pairs_built


# bf16 blocks hold their 32 columns interleaved (the kernel widens them without shuffles):
# stored position 2j is column j and 2j + 1 is column 16 + j. _BF16_ORDER[p] is the column at
# stored position p; _BF16_UNDO puts stored positions back in column order.
_BF16_ORDER = torch.stack([torch.arange(BW // 2), torch.arange(BW // 2) + BW // 2], 1).reshape(-1)
_BF16_UNDO = torch.argsort(_BF16_ORDER)


@dataclass(slots=True)
class PackedWeight:
    """A [in, out] weight packed in column blocks: ``blocks`` [ceil(out / 32), in, 32]
    (bf16: each block's columns interleaved, see ``_BF16_ORDER``), or for bf16 in pairs
    (``pairs``): [ceil(out / 32), ceil(in / 2), 64], row 2p and 2p + 1 of each of the block's
    32 columns side by side (``csrc/small_gemm.c``)."""

    blocks: torch.Tensor
    in_features: int
    out_features: int
    rows: torch.Tensor | None = None  # fp32 only, optional: the plain [in, out] weight for the BLAS
    pairs: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks.dtype

    @property
    def layout(self) -> int:
        """The kernel's layout code: 0 fp32 blocks, 1 bf16 blocks, 2 bf16 pairs."""
        return 2 if self.pairs else int(self.dtype == torch.bfloat16)

    def unpacked(self) -> torch.Tensor:
        """The [in, out] weight back (a copy)."""
        nb, i, _ = self.blocks.shape
        if self.pairs:  # [nb, p, column, row of the pair] -> [2p + row, nb * 32]
            w = self.blocks.view(nb, i, BW, 2).permute(1, 3, 0, 2).reshape(2 * i, nb * BW)
            return w[: self.in_features, : self.out_features].contiguous()
        blocks = self.blocks[:, :, _BF16_UNDO] if self.dtype == torch.bfloat16 else self.blocks
        return blocks.permute(1, 0, 2).reshape(i, nb * BW)[:, : self.out_features].contiguous()


_HUGE = 2 << 20  # bytes in an x86-64 transparent huge page
_MADV_HUGEPAGE = 14


def into_huge_pages(weights: list[PackedWeight]) -> bool:
    """Move the blocks of ``weights`` into one buffer advised for transparent huge pages
    (``madvise(MADV_HUGEPAGE)`` before the first write; Linux, where THP is "always" or
    "madvise"). A decode step streams every weight once, and with 4 KB pages that is a TLB
    miss every 4 KB (in a VM, a two-level page walk): measured here (SmolLM2-135M, 2 threads,
    the two layouts in one process, both orders) a 1 / 5-token forward took 4-10% less in fp32
    and bf16. ``ADAPTSPEC_CPU_HUGE_PAGES=0`` leaves the weights where they are. Returns
    whether the weights moved (False where madvise is unavailable or refused: nothing changes)."""
    if not weights or not sys.platform.startswith("linux"):
        return False
    if os.environ.get("ADAPTSPEC_CPU_HUGE_PAGES", "1").lower() in ("0", "off", "false", "no"):
        return False
    sizes = [-(-w.blocks.numel() * w.blocks.element_size() // 64) * 64 for w in weights]
    span = -(-sum(sizes) // _HUGE) * _HUGE  # whole huge pages, all inside the buffer
    buf = torch.empty(span + _HUGE, dtype=torch.uint8)  # untouched: no page is mapped yet
    start = -(-buf.data_ptr() // _HUGE) * _HUGE
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(start, span, _MADV_HUGEPAGE) != 0:
            return False
    except (OSError, AttributeError):
        return False
    off = start - buf.data_ptr()
    for w, n in zip(weights, sizes):
        nbytes = w.blocks.numel() * w.blocks.element_size()
        view = buf[off:off + nbytes].view(w.blocks.dtype).view(w.blocks.shape)
        view.copy_(w.blocks)
        w.blocks = view
        off += n
    return True


def pack(w_t: torch.Tensor, blas_copy: bool = False, pairs: bool | None = None) -> PackedWeight:
    """Pack a [in, out] weight (fp32 or bf16, CPU) for ``matmul``. ``blas_copy`` (fp32)
    also keeps the plain weight, which ``matmul`` gives to torch for one-row products and for
    more than ``MAX_ROWS_F32`` rows (prefills: one GEMM instead of one per column block).
    ``pairs`` (bf16): the pair layout; None: where ``bf16_pairs()``."""
    if w_t.dim() != 2 or w_t.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"pack: want a 2-D fp32/bf16 weight, got {tuple(w_t.shape)} {w_t.dtype}")
    i, o = w_t.shape
    nb = (o + BW - 1) // BW
    if w_t.dtype == torch.bfloat16 and (bf16_pairs() if pairs is None else pairs):
        p = torch.zeros(i + (i & 1), nb * BW, dtype=w_t.dtype)
        p[:i, :o] = w_t
        blocks = p.view(p.shape[0] // 2, 2, nb, BW).permute(2, 0, 3, 1)  # [nb, pair, column, row]
        return PackedWeight(blocks.reshape(nb, p.shape[0] // 2, 2 * BW).contiguous(), i, o, pairs=True)
    p = torch.zeros(i, nb * BW, dtype=w_t.dtype)
    p[:, :o] = w_t
    blocks = p.view(i, nb, BW).permute(1, 0, 2)
    if w_t.dtype == torch.bfloat16:
        blocks = blocks[:, :, _BF16_ORDER]
    rows = w_t.contiguous() if blas_copy and w_t.dtype == torch.float32 else None
    return PackedWeight(blocks.contiguous(), i, o, rows)


def matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """``x @ W`` for x [..., in] in the weight's dtype; the result in x's dtype.

    Kept lean: a decode step makes 121 of these calls (SmolLM2); the first version's reshapes
    and conversions cost 2-3 ms more over those calls (fp32 rows, a throwaway timing)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, w.in_features)
    m = x2.shape[0]
    if w.rows is not None and (m > MAX_ROWS_F32 or (m == 1 and ONE_ROW_BLAS)):  # the BLAS: a GEMM's worth
        y = x2 @ w.rows
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], w.out_features)
    bf16 = w.blocks.dtype == torch.bfloat16
    if w.pairs and (_lib is None or not _pairs_built or m == 0):  # torch on the weight unpacked
        y = x2.to(w.dtype) @ w.unpacked()
        return y.to(x.dtype).reshape(*x.shape[:-1], w.out_features)
    if _lib is None or m == 0 or (not bf16 and m > MAX_ROWS_F32):
        # torch on the packed blocks: [nb, m, 32] (bf16: back in column order) -> [m, out]
        y = torch.matmul(x2.to(w.dtype), w.blocks)
        if bf16:
            y = y[:, :, _BF16_UNDO]
        y = y.permute(1, 0, 2).reshape(m, -1)[:, : w.out_features]
        return y.to(x.dtype).reshape(*x.shape[:-1], w.out_features)
    xf = x2 if x2.dtype == torch.float32 else x2.float()
    if not xf.is_contiguous():
        xf = xf.contiguous()
    y = torch.empty(m, w.out_features, dtype=torch.float32)
    _lib.adaptspec_small_gemm(m, w.in_features, w.out_features, xf.data_ptr(), w.in_features,
                              w.blocks.data_ptr(), w.layout, y.data_ptr(), w.out_features,
                              torch.get_num_threads())
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], w.out_features)
