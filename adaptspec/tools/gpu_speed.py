"""The GPU check's speed sections: copy bandwidth, a random-weight model, decode through the
engine (eager and with CUDA graphs), the cost of verification by token count, speculative
decoding with a self-draft and with n-gram lookup (each eager and with CUDA graphs: with a
draft, its drafting passes replay graphs too) (``adaptspec.tools.gpu_check`` runs them
and writes what they return)."""
from __future__ import annotations

import copy
import statistics
import time
import traceback


class SectionTimeout(BaseException):
    """A section ran past its hard cap. A BaseException, so the sections' own ``except
    Exception`` (one batch size failing leaves the others) lets it through."""


def error_record(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}"[:1000],
            "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__))[-2500:]}


def relative(costs: dict[int, float], base: int = 1) -> dict[int, float]:
    """Each cost over the cost at ``base`` (e.g. verifying n tokens over verifying one)."""
    if base not in costs or not costs[base] > 0:
        raise ValueError(f"relative: no positive cost at {base}")
    return {n: c / costs[base] for n, c in sorted(costs.items())}


def copy_bandwidth(nbytes: int, seconds: float) -> float:
    """Bytes per second a copy of ``nbytes`` moved: it reads them and writes them."""
    if nbytes <= 0 or not seconds > 0:
        raise ValueError(f"copy_bandwidth: needs bytes > 0 and seconds > 0, got {nbytes}, {seconds}")
    return 2.0 * nbytes / seconds


# ---- timing -----------------------------------------------------------------------------------

def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def time_ms(fn, device: str, reps: int, warmup: int = 2) -> list[float]:
    """Wall milliseconds of each of ``reps`` calls (device synchronised around each)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def bandwidth_section(opts) -> dict:
    import torch

    n = (64 if opts.tiny or opts.device == "cpu" else 2048) * 2**20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=opts.device)
    dst = torch.empty_like(src)
    times = time_ms(lambda: dst.copy_(src), opts.device, reps=10, warmup=3)
    best, med = min(times) / 1e3, statistics.median(times) / 1e3
    del src, dst
    return {"copy_bytes": n, "reps": len(times), "best_ms": round(best * 1e3, 4), "median_ms": round(med * 1e3, 4),
            "bytes_per_s_best": copy_bandwidth(n, best), "bytes_per_s_median": copy_bandwidth(n, med),
            "note": "a device-to-device copy; bytes read plus bytes written per second"}


# ---- the model and the engine -------------------------------------------------------------

def model_section(opts, state: dict) -> dict:
    import torch

    from adaptspec.models.synthetic import LLAMA31_8B, TINY, random_model, weight_bytes

    cfg = TINY if opts.tiny else LLAMA31_8B
    dtype = "fp32" if opts.tiny else "bf16"
    t0 = time.perf_counter()
    # on the CPU the torch reference matmul: the same code path as on CUDA, no C kernel build
    tgt = random_model(cfg, dtype, opts.device, matmul="reference", name="random-llama31-8b-shape")
    _sync(opts.device)
    state["target"] = tgt
    c = tgt.model.cfg
    out = {"shape": {"hidden": c.hidden_size, "layers": c.num_layers, "heads": c.num_heads,
                     "kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "intermediate": c.intermediate_size,
                     "vocab": c.vocab_size},
           "shape_of": "tiny" if opts.tiny else "Llama-3.1-8B", "dtype": str(tgt.model.dtype).replace("torch.", ""),
           "weight_bytes": weight_bytes(tgt.model),
           "kv_bytes_per_token": 2 * c.num_layers * c.num_kv_heads * c.head_dim * tgt.model.compute_dtype.itemsize,
           "attention": getattr(tgt.model.attn, "name", type(tgt.model.attn).__name__),
           "build_s": round(time.perf_counter() - t0, 2)}
    if opts.device == "cuda":
        out["memory_allocated_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    return out


def _graphs_here(opts) -> bool:
    return opts.device == "cuda" or opts.graphs_on_cpu


def engine_fields() -> set[str]:
    from dataclasses import fields

    from adaptspec.engine.engine import EngineConfig

    return {f.name for f in fields(EngineConfig)}


def make_engine(target, *, graphs: bool | None, max_num_seqs: int, max_model_len: int, draft=None, **extra):
    """An engine on ``target``; ``graphs`` True/False sets ``cuda_graphs`` where the engine
    has it (None: its default). Unknown extra fields are dropped (older engines)."""
    from adaptspec.engine.engine import Engine, EngineConfig

    have = engine_fields()
    kw = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
              max_num_batched_tokens=max(1024, 8 * max_num_seqs), enable_prefix_caching=False,
              suffix_drafter=False)
    if graphs is not None and "cuda_graphs" in have:
        kw["cuda_graphs"] = graphs
    kw.update({k: v for k, v in extra.items() if k in have})
    return Engine(target, draft, EngineConfig(**kw))


def _prompts(n: int, length: int, vocab: int, seed: int, repetitive: bool = False) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if repetitive:  # a 12-token phrase again and again: n-gram lookup has matches from the start
            phrase = torch.randint(0, vocab, (12,), generator=g).tolist()
            out.append((phrase * (length // 12 + 1))[:length])
        else:
            out.append(torch.randint(0, vocab, (length,), generator=g).tolist())
    return out


def run_timed(engine, prompts, spec, *, warmup_steps: int, steps: int, max_new_tokens: int) -> dict:
    """Add the requests, step until each has its first token (prefill), ``warmup_steps``
    more, then time ``steps`` steps (wall; each step ends in its one host transfer). Aborts
    whatever is left."""
    from adaptspec.engine.params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params, spec) for p in prompts]
    got = {r: 0 for r in rids}
    guard = 0
    while min(got.values()) == 0:
        for o in engine.step():
            got[o.request_id] = got.get(o.request_id, 0) + len(o.new_token_ids)
        guard += 1
        if guard > 10_000:
            raise RuntimeError("prefill did not finish")
    for _ in range(warmup_steps):
        engine.step()
    before = copy.deepcopy(engine.totals)  # counters are committed within each step
    step_ms: list[float] = []
    try:
        t0 = time.perf_counter()
        emitted = 0
        n = 0
        for _ in range(steps):
            if not engine.has_unfinished():
                break
            t_step = time.perf_counter()
            outs = engine.step()  # ends in the step's host transfer: the device work is done
            step_ms.append((time.perf_counter() - t_step) * 1e3)
            emitted += sum(len(o.new_token_ids) for o in outs)
            n += 1
        wall = time.perf_counter() - t0
    finally:
        after = copy.deepcopy(engine.totals)
        for r in rids:
            engine.abort(r)
    drafted, accepted = after.drafted - before.drafted, after.accepted - before.accepted
    req_steps = after.steps - before.steps
    return {"batch": len(prompts), "steps": n, "wall_s": round(wall, 4), "emitted": emitted,
            "tokens_per_s": round(emitted / wall, 2) if wall > 0 else None,
            "step_ms": round(1e3 * wall / n, 4) if n else None,
            "step_ms_median": round(statistics.median(step_ms), 4) if step_ms else None,
            "drafted": drafted, "accepted": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "mean_accepted_length": round(emitted / req_steps, 4) if req_steps else None}


def _lengths(opts) -> tuple[int, int]:
    """(prompt tokens, max_model_len) of the speed runs."""
    return (32, 256) if opts.tiny else (128, 512)


def decode_section(opts, state: dict, graphs: bool) -> dict:
    from adaptspec.engine.params import SpecConfig

    if graphs and not _graphs_here(opts):
        return {"status": "skipped", "reason": "CUDA graphs need a CUDA device"}
    if graphs and "cuda_graphs" not in engine_fields():
        return {"status": "skipped", "reason": "this engine has no EngineConfig.cuda_graphs"}
    tgt = state["target"]
    prompt_len, max_len = _lengths(opts)
    steps, warm = opts.decode_steps, 3
    t0 = time.perf_counter()
    eng = make_engine(tgt, graphs=graphs, max_num_seqs=max(opts.batches), max_model_len=max_len,
                      cuda_graph_max_tokens=max(opts.batches))
    out = {"mode": "graphs" if graphs else "eager", "engine_build_s": round(time.perf_counter() - t0, 2),
           "context_tokens": prompt_len + warm, "prompt_tokens": prompt_len, "by_batch": {}, "errors": {}}
    for b in opts.batches:
        try:
            out["by_batch"][str(b)] = run_timed(eng, _prompts(b, prompt_len, tgt.vocab_size, seed=b), SpecConfig(),
                                                warmup_steps=warm, steps=steps, max_new_tokens=steps + warm + 8)
        except Exception as e:  # one batch size failing leaves the others
            out["errors"][str(b)] = error_record(e)
    out["cuda_graphs"] = getattr(eng.config, "cuda_graphs", None)
    state["plain_" + out["mode"]] = out["by_batch"]
    return out


def fixed_proposer():
    """A drafter proposing ``k`` copies of the last token: the step verifies k + 1 rows
    whatever is accepted (the cost of verification by token count, not a drafter)."""
    from adaptspec.engine.proposers import Draft, Proposer

    class FixedProposer(Proposer):
        name = "fixed"

        def propose(self, seqs, ks):
            return [Draft([s.token_ids[-1]] * k, None, None) for s, k in zip(seqs, ks)]

    return FixedProposer()


def forward_cost(model, device: str, ctx: int, max_tokens: int = 9, reps: int = 10) -> dict[int, float]:
    """Median ms of the model's forward over ``n`` new tokens of one sequence with ``ctx``
    cached positions, n = 1..max_tokens (eager: the model alone, no engine)."""
    from adaptspec.models.batch import FlatBatch

    bs = 16
    blocks = -(-(ctx + max_tokens) // bs)
    if model.num_blocks < blocks or model.block_size != bs:
        model.allocate_kv(blocks, bs)
    table = list(range(blocks))
    out = {}
    for n in range(1, max_tokens + 1):
        batch = FlatBatch.build([[1] * n], [ctx], [table], list(range(n)), bs, model.device)
        out[n] = statistics.median(time_ms(lambda: model.forward(batch), device, reps=reps, warmup=2))
    return out


def verify_cost_section(opts, state: dict) -> dict:
    from adaptspec.engine.params import SpecConfig

    tgt = state["target"]
    prompt_len, max_len = _lengths(opts)
    out: dict = {"tokens": list(range(1, 10)), "context_tokens": prompt_len}
    fwd = forward_cost(tgt.model, opts.device, prompt_len, reps=5 if opts.tiny else 10)
    out["forward"] = {"ms": {str(n): round(v, 4) for n, v in fwd.items()},
                      "relative": {str(n): round(v, 4) for n, v in relative(fwd).items()}}
    state["forward_ms"] = fwd
    modes = [False] + ([True] if _graphs_here(opts) and "cuda_graphs" in engine_fields() else [])
    for graphs in modes:
        key = "engine_graphs" if graphs else "engine"
        try:
            eng = make_engine(tgt, graphs=graphs, max_num_seqs=1, max_model_len=max_len,
                              cuda_graph_max_tokens=16)
            eng.add_proposer("draft", fixed_proposer())
            ms = {}
            for k in range(0, 9):
                spec = SpecConfig("draft", k) if k else SpecConfig()
                r = run_timed(eng, _prompts(1, prompt_len, tgt.vocab_size, seed=100 + k), spec, warmup_steps=2,
                              steps=max(4, opts.decode_steps // 2), max_new_tokens=200)
                ms[k + 1] = r["step_ms_median"]
            out[key] = {"step_ms": {str(n): v for n, v in ms.items()},
                        "relative": {str(n): round(v, 4) for n, v in relative(ms).items()}}
        except Exception as e:
            out[key] = {"status": "error", **error_record(e)}
    return out


def self_draft(target):
    """The target as its own draft: the same weights (no copy), its own KV cache."""
    from adaptspec.models.loader import LoadedModel

    twin = copy.copy(target.model)  # shares every weight tensor; allocate_kv gives it its own cache
    twin.k_cache, twin.v_cache = [], []
    return LoadedModel(name=target.name + "-self", path=target.path, model=twin, tokenizer=target.tokenizer)


def spec_section(opts, state: dict) -> dict:
    from adaptspec.engine.params import SpecConfig

    tgt = state["target"]
    prompt_len, max_len = _lengths(opts)
    k = opts.spec_k
    new = 24 if opts.tiny else 64
    batches = [b for b in opts.batches if b <= 8] or [min(opts.batches)]
    out: dict = {"k": k, "max_new_tokens": new, "runs": {}, "errors": {}}
    # with graphs, the target's steps and the self-draft's k passes replay CUDA graphs (the
    # twin shares the target's weights; each model has its own graph runner, pool and buffers)
    runs = [("self_draft", True, False, False), ("ngram", False, True, False)]
    if _graphs_here(opts) and "cuda_graphs" in engine_fields():
        runs += [("self_draft_graphs", True, False, True), ("ngram_graphs", False, True, True)]
    for name, with_draft, repetitive, graphs in runs:
        plain = state.get("plain_graphs" if graphs else "plain_eager") or {}
        try:
            draft = self_draft(tgt) if with_draft else None
            eng = make_engine(tgt, graphs=graphs, max_num_seqs=max(batches), max_model_len=max_len, draft=draft,
                              cuda_graph_max_tokens=max(batches) * (k + 1))
            draft_graphs = getattr(eng, "draft_graphs", None) is not None
            if with_draft and graphs and not draft_graphs:
                raise RuntimeError("the engine set up no draft graphs with cuda_graphs on")
            for b in batches:
                r = run_timed(eng, _prompts(b, prompt_len, tgt.vocab_size, seed=200 + b, repetitive=repetitive),
                              SpecConfig("draft" if with_draft else "ngram", k), warmup_steps=1,
                              steps=10_000, max_new_tokens=new)
                r["draft_graphs"] = with_draft and draft_graphs
                base = plain.get(str(b), {}).get("tokens_per_s")
                r["speedup_over_plain"] = round(r["tokens_per_s"] / base, 4) if base and r["tokens_per_s"] else None
                plain_ms = plain.get(str(b), {}).get("step_ms")
                if with_draft and plain_ms and r["step_ms"]:
                    # a self-draft's step is k one-token passes of the target and one k+1-token
                    # verification: about k + 1 plain steps of the same mode. Above 1, what the
                    # speculative step adds; below, what its passes save (no sampling or host
                    # round trip between the draft's passes)
                    r["step_over_k_plus_1_plain"] = round(r["step_ms"] / ((k + 1) * plain_ms), 4)
                out["runs"][f"{name}/b{b}"] = r
            del eng, draft
        except Exception as e:
            out["errors"][name] = error_record(e)
    return out




def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (the device's busy time when
    kernels and copies overlap on several streams)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def profile_summary(events, steps: int, wall_s: float, top: int = 12) -> dict:
    """Where the profiled steps' time went: the wall per step, the device's busy time per
    step (the union of its kernels and copies), the rest (the host's share: Python, launches,
    waits), the kernels by device time and the host ops by their own CPU time, per step."""
    from torch.autograd import DeviceType

    dev, host = [], {}
    for e in events:
        if e.device_type == DeviceType.CUDA:
            dev.append(e)
        elif e.device_type == DeviceType.CPU:
            h = host.setdefault(e.name, [0, 0.0])
            h[0] += 1
            h[1] += e.self_cpu_time_total
    wall_ms = 1e3 * wall_s / steps
    out: dict = {"steps": steps, "wall_ms_per_step": round(wall_ms, 4)}
    if dev:
        busy = union_us([(e.time_range.start, e.time_range.end) for e in dev]) / 1e3 / steps
        by_name: dict[str, list] = {}
        for e in dev:
            k = by_name.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.time_range.elapsed_us()
        out.update(device_busy_ms_per_step=round(busy, 4), host_ms_per_step=round(wall_ms - busy, 4),
                   device_busy_share=round(busy / wall_ms, 4) if wall_ms else None)
        out["kernels"] = [{"name": n[:100], "calls_per_step": round(c / steps, 2), "ms_per_step": round(us / 1e3 / steps, 4)}
                          for n, (c, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]]
    else:
        out.update(device_busy_ms_per_step=None, host_ms_per_step=None, device_busy_share=None, kernels=[])
    out["host_ops"] = [{"name": n[:100], "calls_per_step": round(c / steps, 2), "self_ms_per_step": round(us / 1e3 / steps, 4)}
                       for n, (c, us) in sorted(host.items(), key=lambda kv: -kv[1][1])[:top]]
    return out


def profile_section(opts, state: dict) -> dict:
    """Where a batch-1 decode step's time goes: ``torch.profiler`` over engine steps, with
    CUDA graphs where they run and eager. A step well above the bandwidth floor is either
    slow kernels (device busy near the wall) or the host (device idle between them)."""
    from torch.profiler import ProfilerActivity, profile

    from adaptspec.engine.params import SamplingParams, SpecConfig

    tgt = state["target"]
    prompt_len, max_len = _lengths(opts)
    steps = 6 if opts.tiny else 20
    modes = ([True] if _graphs_here(opts) and "cuda_graphs" in engine_fields() else []) + [False]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if opts.device == "cuda" else [])
    out: dict = {"batch": 1, "context_tokens": prompt_len, "modes": {}, "errors": {}}
    for graphs in modes:
        key = "graphs" if graphs else "eager"
        try:
            eng = make_engine(tgt, graphs=graphs, max_num_seqs=1, max_model_len=max_len, cuda_graph_max_tokens=1)
            params = SamplingParams(max_new_tokens=steps + 16, temperature=0.0, ignore_eos=True)
            rid = eng.add_request(_prompts(1, prompt_len, tgt.vocab_size, seed=7)[0], params, SpecConfig())
            for _ in range(6):  # the prompt, then warm steps (graph capture happens here)
                eng.step()
            with profile(activities=acts) as prof:
                t0 = time.perf_counter()
                for _ in range(steps):
                    eng.step()  # ends in the step's host transfer
                wall = time.perf_counter() - t0
            eng.abort(rid)
            out["modes"][key] = profile_summary(prof.events(), steps, wall)
            del eng
        except Exception as e:
            out["errors"][key] = error_record(e)
    return out


def long_context_section(opts, state: dict) -> dict:
    """Plain decode over a long context (4,096 tokens; tiny: 256), with graphs where they run:
    each step against its bandwidth floor, which counts the KV cache the step reads. Twice:
    with the attention's context split as the engine chooses (``auto``) and never split
    (``0``, one program per row and kv head walking the whole context)."""
    import os

    from adaptspec.engine.params import SpecConfig
    from adaptspec.models.synthetic import weight_bytes

    tgt = state["target"]
    c = tgt.model.cfg
    ctx = 256 if opts.tiny else 4096
    batches = [b for b in (1, 8) if b <= max(opts.batches)] or [1]
    graphs = _graphs_here(opts) and "cuda_graphs" in engine_fields()
    steps = opts.decode_steps
    kv_tok = 2 * c.num_layers * c.num_kv_heads * c.head_dim * tgt.model.compute_dtype.itemsize
    bw = state.get("bytes_per_s")
    out: dict = {"context_tokens": ctx, "mode": "graphs" if graphs else "eager", "by_split": {}, "errors": {}}
    before = os.environ.get("ADAPTSPEC_ATTENTION_SPLIT")
    try:
        for split in ("auto", "0"):
            os.environ["ADAPTSPEC_ATTENTION_SPLIT"] = split  # read when a step (or its graph) is built
            eng = make_engine(tgt, graphs=graphs, max_num_seqs=max(batches), max_model_len=ctx + steps + 64,
                              cuda_graph_max_tokens=max(batches))
            rows = out["by_split"][split] = {}
            for b in batches:
                try:
                    r = run_timed(eng, _prompts(b, ctx, tgt.vocab_size, seed=300 + b), SpecConfig(), warmup_steps=3,
                                  steps=steps, max_new_tokens=steps + 8)
                    if bw and r["step_ms"]:
                        floor_ms = 1e3 * (weight_bytes(tgt.model)["per_decode_step"] + kv_tok * ctx * b) / bw
                        r["floor_ms"] = round(floor_ms, 4)
                        r["over_floor"] = round(r["step_ms"] / floor_ms, 4)
                    rows[str(b)] = r
                except Exception as e:
                    out["errors"][f"{split}/{b}"] = error_record(e)
            del eng
    finally:
        if before is None:
            os.environ.pop("ADAPTSPEC_ATTENTION_SPLIT", None)
        else:
            os.environ["ADAPTSPEC_ATTENTION_SPLIT"] = before
    out["by_batch"] = out["by_split"].get("auto", {})
    return out
