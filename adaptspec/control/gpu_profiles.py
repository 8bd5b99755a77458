"""Built-in cost profiles: GPU (H100, H200; 8B, 70B TP4 targets; 1B, 8B drafts) and CPU.

GPU profiles are built from the measured H100 per-layer operator times in
``../shared/data/profiles`` (microsoft/vidur profiling data, MIT), fitted by
``python -m adaptspec.sim.fit_profiles`` into the numbers below; the data files are not
part of the project. Assumptions, every one of them:

1. Linear layers. Llama-3-8B layers = the measured Llama-2-7B layers x 1.0776 (ratio of
   linear parameters per layer, 218.1M / 202.4M; both have hidden 4096). Llama-3-70B
   layers = the measured Llama-2-70B layers (identical layer shapes). Llama-3.2-1B
   layers = the measured phi-2 (2.7B) layers x 0.773 (60.8M / 78.6M linear parameters per
   layer). Layers: 32 (8B), 80 (70B), 16 (1B).
2. Output layer (vocabulary 128256) = the measured fused gate/up projection of the same
   source model x (vocab / its output columns): 8B 5.83, 70B TP4 2.237 (per GPU), 1B 10.02.
   It runs over every verified token (all k + 1 positions need logits); prefill chunks pay
   it too (an overestimate: only the last prompt token needs logits).
3. Tensor parallelism (70B, and the 8B draft beside it): TP = 4 on NVLink; the measured
   TP-4 layer times plus two all-reduces per layer of N x hidden x 2 bytes, each
   10 us + 2 (tp - 1) / tp x bytes / 300 GB/s.
4. Attention = bytes of KV cache read / (0.8 x peak memory bandwidth): H100 SXM 3.35 TB/s,
   H200 4.8 TB/s. KV bytes per token (bf16) per GPU: 8B 131072, 70B 327680 / 4 = 81920,
   1B 32768, 8B at TP4 32768. Verification reads each request's KV once however many
   tokens it verifies; attention FLOPs (prefill) are ignored.
5. H200 has the H100's compute: its linear-layer times = max(r t(1), t(N) - (1 - r) t(1))
   with r = 3.35 / 4.8 (the memory-bound floor t(1) scales with bandwidth).
6. Host overhead per step (scheduling, sampling, rejection, Python): 1.0 ms (8B), 1.5 ms
   (70B). n-gram lookup: 20 us per request on the host.
7. KV capacity: 90% of GPU memory minus bf16 weights of target and draft, divided by the
   KV bytes per token of both models. Running requests at most 256; step token budget
   8192 (chunked prefill).

``match_gpu_profile`` prices another model on an H100 or H200 the same way: the measured
layer source whose linear parameters per layer are nearest the model's (within 2x either
way), scaled by their ratio as in 1., the output layer as in 2., the KV bytes from the
model's own heads; a draft model likewise (otherwise the built-in 1B draft). It refuses
(``ProfileMismatch``, with the reason) a GPU other than H100/H200, a dtype other than
bf16/fp16, and a model too far from every source to scale (e.g. 0.5B: such a model is
bound by kernel launches on these GPUs, not by its layers' arithmetic).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from adaptspec.control.costs import ProfileCostModel, ProfileFile

KNOTS = (1, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
LAYER_MS = {
    "llama2-7b-tp1": ([0.175, 0.175, 0.181, 0.181, 0.1845, 0.228, 0.228, 0.265, 0.287, 0.362, 0.3965, 0.6085, 0.674, 1.043, 1.267, 2.0225, 2.649],
        [0.064, 0.064, 0.0665, 0.067, 0.067, 0.075, 0.075, 0.126, 0.13, 0.143, 0.143, 0.247, 0.2705, 0.422, 0.4925, 0.7595, 1.001]),
    "llama2-7b-tp4": ([0.0635, 0.0635, 0.064, 0.0695, 0.071, 0.0755, 0.0775, 0.088, 0.094, 0.138, 0.141, 0.1835, 0.2425, 0.329, 0.4195, 0.606, 0.7975],
        [0.019, 0.019, 0.019, 0.022, 0.022, 0.022, 0.023, 0.028, 0.029, 0.046, 0.046, 0.0495, 0.096, 0.108, 0.1495, 0.194, 0.259]),
    "llama2-70b-tp4": ([0.179, 0.187, 0.187, 0.193, 0.193, 0.203, 0.203, 0.236, 0.244, 0.377, 0.442, 0.648, 0.78, 1.06, 1.41, 2.23, 2.77825],
        [0.081, 0.085, 0.085, 0.085, 0.087, 0.087, 0.087, 0.105, 0.108, 0.2, 0.2, 0.2915, 0.331, 0.505, 0.6715, 1.081, 1.3545]),
    "phi2-tp1": ([0.082, 0.0845, 0.086, 0.0925, 0.097, 0.102, 0.105, 0.13, 0.13, 0.164, 0.196, 0.2735, 0.3885, 0.4215, 0.562, 0.7995, 1.115],
        [0.022, 0.023, 0.023, 0.024, 0.024, 0.025, 0.026, 0.043, 0.043, 0.048, 0.052, 0.082, 0.121, 0.121, 0.148, 0.216, 0.297]),
}

HBM_TBS = {"h100": 3.35, "h200": 4.8}
MEM_GB = {"h100": 80.0, "h200": 141.0}
BW_EFF = 0.8
ALLREDUCE_LAT_S = 10e-6
NVLINK_BUSBW = 300e9


class _Model:
    """A model as the profiles see it (per GPU when tensor-parallel)."""

    def __init__(self, source: str, scale: float, layers: int, head_ratio: float, hidden: int, kv_bytes: int,
                 params_b: float, tp: int) -> None:
        self.source, self.scale, self.layers, self.head_ratio = source, scale, layers, head_ratio
        self.hidden, self.kv_bytes, self.params_b, self.tp = hidden, kv_bytes, params_b, tp

    def linear_s(self, gpu: str) -> np.ndarray:
        """[len(KNOTS)] seconds of all linear layers + output layer + collectives."""
        layer, up = (np.array(x) for x in LAYER_MS[self.source])
        per_layer = layer * self.scale
        head = up * self.head_ratio
        if gpu == "h200":
            r = HBM_TBS["h100"] / HBM_TBS["h200"]
            per_layer = np.maximum(r * per_layer[0], per_layer - (1 - r) * per_layer[0])
            head = np.maximum(r * head[0], head - (1 - r) * head[0])
        ms = self.layers * per_layer + head
        if self.tp > 1:
            nbytes = np.array(KNOTS, dtype=float) * self.hidden * 2
            ar = ALLREDUCE_LAT_S + 2 * (self.tp - 1) / self.tp * nbytes / NVLINK_BUSBW
            ms = ms + 1e3 * 2 * self.layers * ar
        return ms * 1e-3

    def context_s_per_token(self, gpu: str) -> float:
        return self.kv_bytes / (BW_EFF * HBM_TBS[gpu] * 1e12)


MODELS = {
    "8b": _Model("llama2-7b-tp1", 1.0776, 32, 5.83, 4096, 131072, 8.0, 1),
    "8b-tp4": _Model("llama2-7b-tp4", 1.0776, 32, 5.83, 4096, 32768, 8.0, 4),
    "70b-tp4": _Model("llama2-70b-tp4", 1.0, 80, 2.237, 8192, 81920, 70.6, 4),
    "1b": _Model("phi2-tp1", 0.773, 16, 10.02, 2048, 32768, 1.24, 1),
}
GPU_PROFILES = {
    f"{gpu}-{t}-{d}": (gpu, t, d)
    for gpu in ("h100", "h200")
    for t, d in (("8b", "1b"), ("70b-tp4", "8b-tp4"), ("70b-tp4", "1b"))
}


def gpu_profile(name: str) -> ProfileFile:
    if name not in GPU_PROFILES:
        raise ValueError(f"hardware.profile: unknown {name!r}; built-in: {sorted(BUILTIN)}")
    gpu, t_name, d_name = GPU_PROFILES[name]
    return _profile(gpu, MODELS[t_name], MODELS[d_name],
                    name=f"{gpu.upper()} {t_name} target + {d_name} draft (built from H100 layer profiles)")


def _profile(gpu: str, target: _Model, draft: _Model, name: str) -> ProfileFile:
    tp = target.tp
    # weights per GPU; a TP-1 draft beside a TP-4 target sits on one GPU, counted there
    weights_gb = 2 * target.params_b / tp + 2 * draft.params_b / draft.tp
    kv_gb = 0.9 * MEM_GB[gpu] - weights_gb
    kv_tokens = int(kv_gb * 1e9 / (target.kv_bytes + draft.kv_bytes))
    draft_batch = [1, 8, 16, 32, 64, 96, 128, 192, 256]
    d_lin = draft.linear_s(gpu)[: len(draft_batch)]
    return ProfileFile(
        name=name,
        verify_tokens=[float(k) for k in KNOTS], verify_s=[float(x) for x in target.linear_s(gpu)],
        verify_context_s_per_token=target.context_s_per_token(gpu),
        draft_batch=[float(b) for b in draft_batch], draft_s=[float(x) for x in d_lin],
        draft_context_s_per_token=draft.context_s_per_token(gpu),
        ngram_s_per_request=20e-6, step_overhead_s=1.0e-3 if target.tp == 1 else 1.5e-3,
        kv_capacity_tokens=kv_tokens, max_num_seqs=256, max_batched_tokens=8192, calibrated=False,
        notes=["built by adaptspec.control.gpu_profiles; see its docstring for every assumption"])


def cpu_profile(dtype: str) -> ProfileFile:
    """SmolLM2-135M target on this machine's CPU, from the numbers stated in the project's
    issues (NOT calibrated from the live engine): a decode step of 38 ms (bf16) / 60 ms
    (fp32) at batch 1; verifying 5 tokens costs 1.1x one token (bf16); 160 tokens/s at batch
    32 (bf16), i.e. 200 ms for 32 tokens; fp32 scaled by 60/38. Draft: a 14M-parameter
    draft at cost ratio 0.12 at batch 1, growing like the target. n-gram lookup 0.2 ms per
    request (Python). Host overhead 2 ms. KV: 30 layers x 3 KV heads x 64 x 2 bytes x 2."""
    s = 1.0 if dtype == "bf16" else 60.0 / 38.0
    tokens = [1.0, 5.0, 32.0, 256.0, 2048.0]
    slope = (0.200 - 0.0418) / 27.0
    verify = [0.036, 0.0398, 0.198, 0.198 + slope * 224, 0.198 + slope * 2016]
    d1 = 0.12 * 0.038
    return ProfileFile(
        name=f"CPU SmolLM2-135M {dtype} (uncalibrated: from stated numbers)",
        verify_tokens=tokens, verify_s=[v * s for v in verify],
        verify_context_s_per_token=23040 / 20e9,
        draft_batch=[1.0, 32.0, 256.0], draft_s=[d1 * s, 6 * d1 * s, 48 * d1 * s],
        ngram_s_per_request=2e-4, step_overhead_s=2e-3, kv_capacity_tokens=200_000, max_num_seqs=32,
        max_batched_tokens=2048, calibrated=False,
        notes=["not calibrated: derived from numbers stated in issues #3 and #4; run adaptspec calibrate"])


BUILTIN = sorted(GPU_PROFILES) + ["cpu-smollm2-135m-bf16", "cpu-smollm2-135m-fp32"]


def builtin_profile(name: str) -> ProfileCostModel:
    if name.startswith("cpu-smollm2-135m-"):
        dtype = name.rsplit("-", 1)[1]
        if dtype in ("bf16", "fp32"):
            return ProfileCostModel(cpu_profile(dtype))
    return ProfileCostModel(gpu_profile(name))


# ---- matching a model's shapes to the measured layers ------------------------------------

@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the profiles need of a Llama-family model (whole model; ``tp`` splits it)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int | None = None  # None: hidden / heads
    dtype_bytes: int = 2
    gated_mlp: bool = True  # SwiGLU (gate, up, down); False: two matrices (phi-2)
    tp: int = 1
    tied: bool = False  # the output layer is the embedding

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def linear_params_per_layer(self) -> float:
        """Per GPU: q, k, v, o and the MLP's matrices."""
        attn = self.hidden * self.hd * (2 * self.heads + 2 * self.kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return (attn + mlp) / self.tp

    def kv_bytes_per_token(self) -> int:
        """Per GPU: keys and values of every layer."""
        return int(2 * self.layers * self.kv_heads * self.hd * self.dtype_bytes / self.tp)

    def params_b(self) -> float:
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return (self.layers * self.linear_params_per_layer() * self.tp + emb) / 1e9

    @classmethod
    def from_config(cls, cfg: dict, dtype: str = "bfloat16", tp: int = 1) -> "ModelShape":
        """From a transformers ``config.json`` (as a dict)."""
        try:
            heads = int(cfg["num_attention_heads"])
            return cls(hidden=int(cfg["hidden_size"]), layers=int(cfg["num_hidden_layers"]), heads=heads,
                       kv_heads=int(cfg.get("num_key_value_heads") or heads),
                       intermediate=int(cfg["intermediate_size"]), vocab=int(cfg["vocab_size"]),
                       head_dim=cfg.get("head_dim"), dtype_bytes=DTYPE_BYTES.get(dtype, 0), tp=tp,
                       tied=bool(cfg.get("tie_word_embeddings", False)))
        except KeyError as e:
            raise ProfileMismatch(f"config.json has no {e.args[0]}") from None


DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4, "fp32": 4}
# the measured sources as models: (shape, gate/up output columns of the whole model)
SOURCES = {
    "llama2-7b-tp1": (ModelShape(4096, 32, 32, 32, 11008, 32000), 2 * 11008),
    "llama2-7b-tp4": (ModelShape(4096, 32, 32, 32, 11008, 32000, tp=4), 2 * 11008),
    "llama2-70b-tp4": (ModelShape(8192, 80, 64, 8, 28672, 32000, tp=4), 2 * 28672),
    "phi2-tp1": (ModelShape(2560, 32, 32, 32, 10240, 51200, gated_mlp=False), 10240),
}
# the built-in models' shapes (Llama-3.1-8B, Llama-3.1-70B, Llama-3.2-1B): names for the log
BUILTIN_SHAPES = {
    "8b": ModelShape(4096, 32, 32, 8, 14336, 128256),
    "70b-tp4": ModelShape(8192, 80, 64, 8, 28672, 128256, tp=4),
    "1b": ModelShape(2048, 16, 32, 8, 8192, 128256, head_dim=64, tied=True),
}
MAX_SCALE = 2.0  # how far a measured layer profile may be scaled (either way)


class ProfileMismatch(ValueError):
    """No built-in GPU profile fits (the message says why)."""


def gpu_kind(device_name: str) -> str | None:
    """"h100" / "h200" from a CUDA device name ("NVIDIA H100 80GB HBM3", "NVIDIA H200",
    "NVIDIA GH200 480GB" counts as an H200: HBM3e at about its bandwidth), else None."""
    name = device_name.upper()
    if re.search(r"H200", name):
        return "h200"
    if re.search(r"\bH100\b", name):
        return "h100"
    return None


def _source_for(shape: ModelShape) -> tuple[str, float]:
    """The measured source with the same tensor parallelism nearest in linear parameters per
    layer, and the scale (ratio) to it."""
    same_tp = [n for n, (src, _) in SOURCES.items() if src.tp == shape.tp]
    if not same_tp:
        raise ProfileMismatch(f"no measured layers at tensor parallelism {shape.tp} (have 1 and 4)")
    name = min(same_tp, key=lambda n: abs(math.log(shape.linear_params_per_layer()
                                                   / SOURCES[n][0].linear_params_per_layer())))
    return name, shape.linear_params_per_layer() / SOURCES[name][0].linear_params_per_layer()


def model_from_shape(shape: ModelShape) -> tuple[_Model, str, float]:
    """A ``_Model`` priced from the nearest measured layers: (model, source, scale)."""
    source, scale = _source_for(shape)
    if not 1 / MAX_SCALE <= scale <= MAX_SCALE:
        src = SOURCES[source][0]
        raise ProfileMismatch(
            f"{shape.linear_params_per_layer() / 1e6:.1f}M linear parameters per layer (per GPU) are {scale:.2f}x "
            f"the nearest measured layers ({source}, {src.linear_params_per_layer() / 1e6:.1f}M); only "
            f"1/{MAX_SCALE:g}x..{MAX_SCALE:g}x is scaled")
    src, up_cols = SOURCES[source]
    head_ratio = shape.vocab * shape.hidden / (up_cols * src.hidden)  # output layer vs measured gate/up
    model = _Model(source, scale, shape.layers, head_ratio, shape.hidden, shape.kv_bytes_per_token(),
                   shape.params_b(), shape.tp)
    return model, source, scale


@dataclass(frozen=True, slots=True)
class ProfileMatch:
    gpu: str  # h100 | h200
    source: str  # the measured layer profile the target's were scaled from
    scale: float  # the target's linear parameters per layer over the source's
    nearest_builtin: str  # the built-in profile of the nearest shape, e.g. h200-8b-1b
    draft: str  # how the draft model was priced
    profile: ProfileFile

    def describe(self) -> str:
        return (f"{self.gpu.upper()}: target layers from {self.source} x {self.scale:.3f} (nearest built-in "
                f"{self.nearest_builtin}); draft: {self.draft}")


def match_gpu_profile(device_name: str, target: ModelShape, draft: ModelShape | None = None) -> ProfileMatch:
    """The built-in H100/H200 profile method applied to ``target`` (and ``draft``) on the GPU
    named ``device_name``; ``ProfileMismatch`` says why not."""
    gpu = gpu_kind(device_name)
    if gpu is None:
        raise ProfileMismatch(f"GPU {device_name!r} is not an H100 or H200 (the built-in profiles' GPUs)")
    if target.dtype_bytes != 2:
        raise ProfileMismatch(f"the built-in profiles are for 2-byte weights (bf16/fp16), the model has "
                              f"{target.dtype_bytes or 'unknown'}-byte ones")
    t_model, source, scale = model_from_shape(target)
    d_model, d_note = MODELS["1b"], "the built-in 1B draft (Llama-3.2-1B shapes)"
    if draft is not None:
        try:
            d_model, d_source, d_scale = model_from_shape(draft)
            d_note = f"layers from {d_source} x {d_scale:.3f}"
        except ProfileMismatch as e:
            d_note += f"; the draft's own shapes do not fit: {e}"
    near = min(("8b", "70b-tp4"), key=lambda n: abs(math.log(BUILTIN_SHAPES[n].params_b() / target.params_b())))
    nearest = f"{gpu}-{near}-{'1b' if near == '8b' else '8b-tp4'}"
    profile = _profile(gpu, t_model, d_model, name=f"{gpu.upper()} {target.params_b():.1f}B-shaped target "
                       f"({source} layers x {scale:.3f}) + draft ({d_note})")
    return ProfileMatch(gpu, source, scale, nearest, d_note, profile)
