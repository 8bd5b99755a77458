"""Compile every kernel variant for a CUDA architecture without a GPU (down to a cubin).

    python -m adaptspec_kernels.compile_check [--arch 90 80]

The interpreter tests cannot see type errors that only the compiler raises; this runs the
real Triton pipeline (ttir -> ttgir -> llir -> ptx -> cubin with the bundled ptxas) for
each constexpr combination. Needs triton imported without TRITON_INTERPRET=1.
"""
from __future__ import annotations

import argparse
import os
import sys

PTR_I64, PTR_F32 = "*i64", "*fp32"


def _variants():
    from adaptspec_kernels import triton_verify as tv

    def sig(names, types):
        return dict(zip(names, types))

    stats = ["logits_ptr", "stride_row", "cu_num_draft_tokens_ptr", "temperature_ptr", "argmax_ptr",
             "stats_ptr", "vocab_size", "GREEDY", "BLOCK_V"]
    for dt in ("fp32", "bf16", "fp16"):
        yield (f"row_stats greedy {dt}", tv._row_stats_kernel,
               sig(stats, [f"*{dt}", "i32", PTR_I64, PTR_I64, PTR_I64, PTR_I64, "i32", "constexpr", "constexpr"]),
               dict(GREEDY=True, BLOCK_V=1024))
        yield (f"row_stats softmax {dt}", tv._row_stats_kernel,
               sig(stats, [f"*{dt}", "i32", PTR_I64, PTR_F32, PTR_F32, PTR_F32, "i32", "constexpr", "constexpr"]),
               dict(GREEDY=False, BLOCK_V=1024))
    greedy = ["argmax_ptr", "draft_token_ids_ptr", "cu_num_draft_tokens_ptr", "out_ptr", "num_accepted_ptr",
              "out_cols", "BLOCK_K"]
    yield ("greedy_accept", tv._greedy_accept_kernel,
           sig(greedy, [PTR_I64] * 5 + ["i32", "constexpr"]), dict(BLOCK_K=8))
    stoch = ["target_ptr", "stride_target", "stats_ptr", "temperature_ptr", "draft_token_ids_ptr",
             "draft_probs_ptr", "stride_draft", "cu_num_draft_tokens_ptr", "uniform_accept_ptr",
             "uniform_sample_ptr", "out_ptr", "num_accepted_ptr", "vocab_size", "out_cols",
             "FROM_LOGITS", "HAS_DRAFT_PROBS", "BLOCK_K", "BLOCK_V"]
    for from_logits in (False, True):
        for has_q in (False, True):
            target = "*bf16" if from_logits else PTR_F32
            yield (f"stochastic_accept from_logits={from_logits} draft_probs={has_q}",
                   tv._stochastic_accept_kernel,
                   sig(stoch, [target, "i32", PTR_F32, PTR_F32, PTR_I64, PTR_F32, "i32", PTR_I64, PTR_F32,
                               PTR_F32, PTR_I64, PTR_I64, "i32", "i32"] + ["constexpr"] * 4),
                   dict(FROM_LOGITS=from_logits, HAS_DRAFT_PROBS=has_q, BLOCK_K=16, BLOCK_V=1024))
    from adaptspec_kernels import triton_attention as ta

    attn = ["q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "seq_of_ptr", "pos_ptr", "block_tables_ptr",
            "stride_bt", "stride_kb", "stride_kh", "scale", "GROUP", "GROUP_P", "D", "BS", "PRECISION", "SPLIT",
            "BLOCKS_PER_SPLIT", "part_m_ptr", "part_l_ptr"]
    combine = ["part_acc_ptr", "part_m_ptr", "part_l_ptr", "out_ptr", "nsplit", "NSPLIT_P", "D"]
    rot = ["qkv_ptr", "q_out_ptr", "k_cache_ptr", "v_cache_ptr", "slot_ptr", "pos_ptr", "cos_ptr", "sin_ptr",
           "stride_qkv", "stride_cos", "stride_kb", "stride_kh", "H", "HKV", "D", "HALF", "BS", "ROUND"]
    for dt, precision, round_ in (("fp32", "ieee", 0), ("bf16", "tf32", 1), ("fp16", "tf32", 2)):
        yield (f"paged_attention {dt}", ta._paged_attention_kernel,
               sig(attn, [f"*{dt}"] * 4 + ["*i32", PTR_I64, "*i32", "i32", "i64", "i64", "fp32"] + ["constexpr"] * 7
                   + [f"*{dt}"] * 2),
               dict(GROUP=4, GROUP_P=16, D=128, BS=16, PRECISION=precision, SPLIT=False, BLOCKS_PER_SPLIT=1))
        yield (f"paged_attention split {dt}", ta._paged_attention_kernel,
               sig(attn, [f"*{dt}"] * 3 + [PTR_F32, "*i32", PTR_I64, "*i32", "i32", "i64", "i64", "fp32"]
                   + ["constexpr"] * 7 + [PTR_F32] * 2),
               dict(GROUP=4, GROUP_P=16, D=128, BS=16, PRECISION=precision, SPLIT=True, BLOCKS_PER_SPLIT=16))
        yield (f"combine_splits {dt}", ta._combine_splits_kernel,
               sig(combine, [PTR_F32] * 3 + [f"*{dt}", "i32", "constexpr", "constexpr"]), dict(NSPLIT_P=16, D=128))
        # with the launch's option (no fused multiply-add: the torch ops' rounding)
        yield (f"rotary_and_write {dt}", ta._rotary_write_kernel,
               sig(rot, [f"*{dt}"] * 4 + [PTR_I64, PTR_I64, f"*{dt}", f"*{dt}", "i32", "i32", "i64", "i64"]
                   + ["constexpr"] * 6),
               dict(H=32, HKV=8, D=128, HALF=64, BS=16, ROUND=round_), {"enable_fp_fusion": False})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m adaptspec_kernels.compile_check")
    ap.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="CUDA compute capabilities")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = 0
    for arch in args.arch:
        for name, fn, signature, constexprs, *options in _variants():
            try:
                kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                        target=GPUTarget("cuda", arch, 32), options=(options or [None])[0])
                print(f"sm_{arch} ok    {name} ({len(kernel.asm['cubin'])} bytes cubin)")
            except Exception as e:  # report every variant, then fail
                failures += 1
                print(f"sm_{arch} FAIL  {name}: {type(e).__name__}: {str(e)[:2000]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
