"""`adaptspec bench`: our plain and speculative decoding against transformers, per class.

For each dtype and batch size, per request class of the shipped prompt set, it measures
tokens/s of: our plain decoding; transformers ``generate``; transformers assisted
generation with the same draft and with prompt lookup (batch 1 only: transformers'
assisted generation does not batch); our engine with the ``ngram`` and ``draft`` drafters
for each k. For our drafters it reports the acceptance rate (accepted / drafted), the per-token
acceptance a (accepted / drafted tokens the target actually judged: a step's candidates
after its first rejection are never judged), the mean accepted length, the measured cost
ratio c (draft time per drafted position / plain target step time), the analytic bound
(1 - a^(k+1)) / ((1 - a)(k c + 1)) and efficiency = decode speedup / bound. Next to c it
reports the verification cost v: a speculative decode step less its drafting (the target
pass over k + 1 tokens per request, plus the step's bookkeeping) over a plain decode step.
The bound takes v = 1.

The methods of a class run interleaved, chunk of ``batch`` prompts by chunk, the first
method rotating, so that the machine's speed drifting during a class hits every method
alike: every ratio below compares runs made minutes apart at most, in turn.

Two speedups: end to end (tokens / wall time, what a user sees for these short 48-token
answers) and decode (tokens / wall time less each step's prefill part). The bound models
decode steps only, and prefill is the same work with or without speculation (in bf16 on
this CPU it is ~0.28 s of a ~2.4 s request), so efficiency compares the decode speedup.

The bound is Leviathan et al.'s expected speedup for i.i.d. per-token acceptance a, so it
takes the per-token a: with accepted / drafted instead (lower: for a = 0.6 and k = 4 it is
0.36) the "bound" falls below speedups actually measured. The bound also assumes that
verifying k + 1 tokens costs one plain step; on this CPU it does not (see the README), and
that is most of what efficiency below 1 measures here.
"""
from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from adaptspec import bench_prompts
from adaptspec.clierr import console as _console
from adaptspec.engine.stats import StepStats


@dataclass(slots=True)
class BenchConfig:
    target: str = "smollm2-135m"
    drafts: list[str] = field(default_factory=list)  # models or draft heads; [] = the default draft
    drafters: list[str] = field(default_factory=lambda: ["ngram", "draft"])
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    batches: list[int] = field(default_factory=lambda: [1, 8])
    ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    classes: list[str] = field(default_factory=list)
    max_new_tokens: int = 48
    prompts_per_class: int = 8
    repeats: int = 1  # rounds over the class's prompts (every method in each round): less noise
    hf: bool = True
    device: str = "cpu"


@dataclass(slots=True)
class BenchRow:
    dtype: str
    batch: int
    request_class: str
    method: str  # ours-plain | ours-ngram | ours-draft | hf-plain | hf-assisted | hf-lookup
    k: int
    tokens: int
    wall_s: float
    tok_s: float
    speedup: float = 1.0  # over ours-plain, same dtype/batch/class
    acceptance: float | None = None  # accepted / drafted
    mean_accepted_length: float | None = None
    cost_ratio: float | None = None
    bound: float | None = None
    efficiency: float | None = None
    same_tokens: bool | None = None  # greedy output equals ours-plain
    draft: str | None = None  # which draft (ours-draft, hf-assisted)
    alpha: float | None = None  # acceptance at the first drafted position: per-token greedy agreement
    token_acceptance: float | None = None  # accepted / judged drafted tokens: the bound's a
    decode_s: float | None = None  # wall time less prefill (ours only): the phase speculation changes
    decode_speedup: float | None = None  # over ours-plain's decode phase; efficiency = this / bound
    verify_cost: float | None = None  # a decode step less its drafting, over a plain decode step (bound: 1)


def analytic_bound(a: float, k: int, c: float) -> float:
    """Expected speedup of k candidates at acceptance a and cost ratio c (Leviathan et al.)."""
    tokens = k + 1 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return tokens / (k * c + 1)


def token_acceptance(steps: list[StepStats]) -> float:
    """Per-token acceptance: accepted / drafted tokens the target judged. A step's
    candidates are judged up to and including the first rejection, so a request that
    accepted j of d drafted tokens had min(j + 1, d) judged."""
    judged = accepted = 0
    for s in steps:
        for r in s.requests:
            if r.drafted:
                judged += min(r.accepted + 1, r.drafted)
                accepted += r.accepted
    return accepted / judged if judged else 0.0


def verify_cost(steps: list[StepStats], plain_step_s: float) -> float:
    """Mean decode step less its drafting, over a plain decode step: what verifying k + 1
    tokens per request (and the step's bookkeeping) costs in plain steps. The analytic bound
    takes it to be 1."""
    if not steps or plain_step_s <= 0:
        return 0.0
    return sum(s.wall_s - s.prefill_s - s.draft_s for s in steps) / len(steps) / plain_step_s


class _StepLog:
    def __init__(self):
        self.steps: list[StepStats] = []

    def __call__(self, st: StepStats) -> None:
        self.steps.append(st)


def run_bench(cfg: BenchConfig, json_path: str | None = None) -> list[BenchRow]:
    from adaptspec import SpecConfig
    from adaptspec.models.registry import DEFAULT_DRAFT

    con = _console()
    prompts = bench_prompts()
    classes = cfg.classes or list(prompts)
    for c in classes:
        if c not in prompts:
            raise ValueError(f"classes: unknown class {c!r} (have {sorted(prompts)})")
    if cfg.repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {cfg.repeats}")
    drafts = cfg.drafts or [DEFAULT_DRAFT]
    for d in cfg.drafters:
        if d not in ("ngram", "draft"):
            raise ValueError(f"drafters: unknown drafter {d!r} (ngram, draft)")
    rows: list[BenchRow] = []
    n_cfg = len(cfg.dtypes) * len(cfg.batches) * len(classes)  # each class advances by 1
    with Progress(console=con, transient=True) as prog:
        task = prog.add_task("bench", total=n_cfg)
        for dtype in cfg.dtypes:
            from adaptspec.engine.engine import Engine as _E, EngineConfig
            from adaptspec.models.loader import LoadedModel, load_draft, load_model

            target = load_model(cfg.target, dtype=dtype, device=cfg.device, quiet=True)
            engines = {}  # one engine per draft, all over the same target weights (run one at a time)
            for d in drafts:
                engines[d] = _E(target, load_draft(d, target, dtype=dtype, device=cfg.device, quiet=True),
                                EngineConfig(max_num_seqs=max(cfg.batches)))
            assisted = next((d for d in drafts if isinstance(engines[d].draft, LoadedModel)), None)
            hf = _HF(engines[drafts[0]], assisted, dtype, cfg.device) if cfg.hf else None
            if hf is not None:
                hf.generate(["warm up"], 8)
            log = _StepLog()
            for e in engines.values():
                e.step_listeners.append(log)
                e.generate(["warm up"], _params(8), SpecConfig("draft", 2))
            for batch in cfg.batches:
                for cls in classes:
                    ps = prompts[cls][:cfg.prompts_per_class]
                    prog.update(task, description=f"{dtype} batch {batch} {cls}")
                    rows += _bench_class(engines, hf, log, ps, cfg, dtype, batch, cls, prog, task)
                    if json_path:  # rewritten after every class: a long run interrupted keeps its rows
                        _write_json(json_path, cfg, rows)
    _print(con, rows)
    if json_path:
        _write_json(json_path, cfg, rows)
        con.print(f"wrote {json_path}")
    return rows


def _write_json(path: str, cfg: BenchConfig, rows: list[BenchRow]) -> None:
    from adaptspec.models import cpu_gemm

    # which CPU kernel the CPU rows ran on (its vector width, or why torch ran instead)
    meta = {"machine": _cpu_name(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_kernel": cpu_gemm.status(), "date": time.strftime("%Y-%m-%d"), "config": asdict(cfg)}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{torch.get_num_threads()} threads"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _params(n):
    from adaptspec import SamplingParams

    return SamplingParams(max_new_tokens=n)


def _bench_class(engines, hf, log, ps, cfg, dtype, batch, cls, prog, task) -> list[BenchRow]:
    """Every method over the class's prompts, interleaved: chunk by chunk (``batch`` prompts),
    each method runs the chunk in turn, the first method rotating from chunk to chunk, so a
    change of the machine's speed during the class hits every method alike (on a shared
    machine it moves by 10-50% within minutes, which one method after the other turned into
    differences between them)."""
    from adaptspec import SpecConfig

    params = _params(cfg.max_new_tokens)
    chunks = [ps[i:i + batch] for i in range(0, len(ps), batch)]
    names = list(engines)
    ours = [("none", 0, names[0])]
    ours += [("ngram", k, names[0]) for k in cfg.ks] if "ngram" in cfg.drafters else []
    ours += [("draft", k, d) for d in names for k in cfg.ks] if "draft" in cfg.drafters else []
    theirs = hf.variants(cfg, batch) if hf is not None else []
    methods = [("ours", m) for m in ours] + [("hf", m) for m in theirs]
    done = [{"outs": [], "wall": 0.0, "steps": [], "stats": []} for _ in methods]
    rounds = [ch for _ in range(cfg.repeats) for ch in chunks]
    for ci, ch in enumerate(rounds):
        order = list(range(len(methods)))
        order = order[ci % len(order):] + order[:ci % len(order)]
        for i in order:
            kind, m = methods[i]
            log.steps.clear()
            t = time.perf_counter()
            if kind == "ours":
                drafter, k, name = m
                res = engines[name].generate(ch, params, SpecConfig(drafter, k))
                outs, stats = [o.token_ids for o in res], [o.stats for o in res]
            else:
                outs, stats = hf.generate(ch, cfg.max_new_tokens, **m[2]), []
            done[i]["wall"] += time.perf_counter() - t
            done[i]["outs"] += outs
            done[i]["stats"] += stats
            done[i]["steps"] += list(log.steps)
            prog.advance(task, 1 / (len(rounds) * len(methods)))

    def decode_time(steps) -> float:  # every step's wall time less its prefill part (same work in every run)
        return sum(s.wall_s - s.prefill_s for s in steps)

    def decode_steps(steps):
        return [s for s in steps if s.num_prefill == 0 and s.batch_size > 0]

    plain = done[0]
    plain_tokens = plain["outs"]
    n_tok = sum(len(t) for t in plain_tokens)
    dec = decode_steps(plain["steps"])
    t_plain_step = sum(s.wall_s for s in dec) / max(len(dec), 1)
    base = BenchRow(dtype, batch, cls, "ours-plain", 0, n_tok, plain["wall"], n_tok / plain["wall"],
                    decode_s=decode_time(plain["steps"]), decode_speedup=1.0)
    rows = [base]
    for (kind, m), res in zip(methods[1:], done[1:]):
        tok, wall = sum(len(x) for x in res["outs"]), res["wall"]
        if kind == "hf":
            name, k, _ = m
            rows.append(BenchRow(dtype, batch, cls, name, k, tok, wall, tok / wall, (tok / wall) / base.tok_s,
                                 same_tokens=res["outs"] == plain_tokens,
                                 draft=hf.draft_name if name == "hf-assisted" else None))
            continue
        drafter, k, dname = m
        st = res["stats"]
        drafted = sum(x.drafted for x in st)
        a = sum(x.accepted for x in st) / max(drafted, 1)
        steps = sum(x.steps for x in st)
        dec = decode_steps(res["steps"])
        passes = sum(max((r.drafted for r in s.requests), default=0) if drafter == "draft" else 1 for s in dec)
        c = (sum(s.draft_s for s in dec) / max(passes, 1)) / max(t_plain_step, 1e-9)
        a_tok = token_acceptance(dec)
        bound = analytic_bound(a_tok, k, c)
        dec_s = decode_time(res["steps"])
        v_cost = verify_cost(dec, t_plain_step)
        dspeed = (tok / dec_s) / (base.tokens / base.decode_s)
        d1 = sum(x.drafted_per_position[0] for x in st)
        alpha = sum(x.accepted_per_position[0] for x in st) / d1 if d1 else None
        rows.append(BenchRow(dtype, batch, cls, f"ours-{drafter}", k, tok, wall, tok / wall, (tok / wall) / base.tok_s,
                             a, sum(x.emitted for x in st) / max(steps, 1), c, bound, dspeed / bound,
                             res["outs"] == plain_tokens, dname if drafter == "draft" else None, alpha, a_tok, dec_s,
                             dspeed, v_cost))
    return rows


class _HF:
    """transformers baselines over the same folders, tokens and dtype."""

    def __init__(self, engine, draft: str | None, dtype: str, device: str):
        from transformers import AutoModelForCausalLM

        from adaptspec.models.loader import parse_dtype
        from adaptspec.models.registry import resolve

        dt = parse_dtype(dtype)
        self.engine = engine
        self.target = AutoModelForCausalLM.from_pretrained(engine.target.path, dtype=dt).to(device).eval()
        self.draft_name = draft  # transformers' assisted generation needs a model draft (not a head)
        self.draft = (AutoModelForCausalLM.from_pretrained(resolve(draft, quiet=True), dtype=dt).to(device).eval()
                      if draft else None)
        self.device = device
        self.eos = engine.tokenizer.eos_token_id

    def generate(self, chunk, n, **kw):
        ids = [self.engine.encode(p) for p in chunk]
        width = max(len(x) for x in ids)
        pad = self.eos if self.eos is not None else 0  # a tokenizer without EOS: pad with 0 (masked)
        inp = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros_like(inp)
        for r, x in enumerate(ids):  # left padding
            inp[r, width - len(x):] = torch.tensor(x)
            mask[r, width - len(x):] = 1
        with torch.inference_mode():
            out = self.target.generate(inp.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=n,
                                       do_sample=False, pad_token_id=pad, **kw)
        res = []
        for row in out[:, width:].tolist():
            res.append(row[:row.index(self.eos) + 1] if self.eos in row else row)
        return res

    def variants(self, cfg, batch: int) -> list[tuple[str, int, dict]]:
        """(method, k, generate() options) of the transformers baselines at this batch size."""
        out = [("hf-plain", 0, {})]
        if batch == 1:  # transformers' assisted generation runs at batch 1 only
            if self.draft is not None:  # it needs a model draft (a draft head has no transformers form)
                out.append(("hf-assisted", 0, {"assistant_model": self.draft}))
            out += [("hf-lookup", k, {"prompt_lookup_num_tokens": k}) for k in cfg.ks]
        return out


def _short(name: str) -> str:
    from rich.markup import escape

    return escape(name.rstrip("/").rsplit("/", 1)[-1])


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def _print(con: Console, rows: list[BenchRow]) -> None:
    keys = sorted({(r.dtype, r.batch) for r in rows}, key=lambda t: (t[0], t[1]))
    for dtype, batch in keys:
        table = Table(title=f"{dtype}, batch {batch}")
        for col in ("class", "method", "k", "tok/s", "speedup", "dec.sp", "alpha", "acc.rate", "a", "acc.len", "c", "v.cost",
                    "bound", "eff.", "exact"):
            table.add_column(col, justify="right" if col not in ("class", "method") else "left")
        for r in rows:
            if (r.dtype, r.batch) != (dtype, batch):
                continue
            many = len({x.draft for x in rows if x.draft}) > 1
            method = r.method + (f" ({_short(r.draft)})" if r.draft and many else "")
            table.add_row(r.request_class, method, str(r.k) if r.k else "-", f"{r.tok_s:.1f}", f"{r.speedup:.2f}x",
                          _fmt(r.decode_speedup), _fmt(r.alpha), _fmt(r.acceptance), _fmt(r.token_acceptance), _fmt(r.mean_accepted_length), _fmt(r.cost_ratio, ".3f"),
                          _fmt(r.verify_cost), _fmt(r.bound), _fmt(r.efficiency), "-" if r.same_tokens is None else
                          ("yes" if r.same_tokens else "no"))
        con.print(table)


# ---- markdown report (the docs' bench tables come from here, not typed by hand) -------
def markdown_report(data: dict) -> str:
    """Goal checks and every row of a ``--json`` result, as markdown.

        python -m adaptspec.tools.bench bench.json > report.md
    """
    rows = data["rows"]
    meta = data.get("meta", {})
    out = [f"Machine: {meta.get('machine', '?')}; torch {meta.get('torch', '?')}, {meta.get('threads', '?')} "
           f"threads; {meta.get('date', '?')}. Greedy, {meta.get('config', {}).get('max_new_tokens', '?')} new tokens.", ""]
    by = {}
    for r in rows:
        by.setdefault((r["dtype"], r["batch"], r["request_class"], r["method"], r["k"]), []).append(r)

    def one(*key):
        v = by.get(key)
        return v[0] if v else None

    out += ["| goal check | dtype | batch | class | ours | reference | verdict |", "|---|---|---|---|---|---|---|"]
    for (dt, b, cls, m, k), v in sorted(by.items()):
        r = v[0]
        if m == "ours-plain":
            hf = one(dt, b, cls, "hf-plain", 0)
            if hf:
                out.append(f"| plain >= transformers plain (tok/s) | {dt} | {b} | {cls} | {r['tok_s']:.1f} | "
                           f"{hf['tok_s']:.1f} | {'met' if r['tok_s'] >= hf['tok_s'] else '**missed**'} |")
        if m == "ours-ngram" and cls == "code_edit":
            hf = one(dt, b, cls, "hf-lookup", k)
            if hf:
                out.append(f"| n-gram k={k} >= transformers prompt lookup (tok/s) | {dt} | {b} | {cls} | "
                           f"{r['tok_s']:.1f} | {hf['tok_s']:.1f} | "
                           f"{'met' if r['tok_s'] >= hf['tok_s'] else '**missed**'} |")
        if m == "ours-draft" and b == 1:
            for x in v:
                out.append(f"| efficiency >= 0.85, draft k={k} ({_short(x.get('draft') or '-')}) | {dt} | {b} | {cls} | "
                           f"{x['efficiency']:.2f} | 0.85 | {'met' if x['efficiency'] >= 0.85 else '**missed**'} |")
    keys = sorted({(r["dtype"], r["batch"]) for r in rows})
    cols = ("class", "method", "k", "tok/s", "speedup", "dec.sp", "alpha", "acc.rate", "a", "acc.len", "c", "v.cost", "bound",
            "eff.", "exact")
    for dt, b in keys:
        out += ["", f"**{dt}, batch {b}**", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        many = len({r.get("draft") for r in rows if r.get("draft")}) > 1
        for r in rows:
            if (r["dtype"], r["batch"]) != (dt, b):
                continue
            method = r["method"] + (f" ({_short(r['draft'])})" if r.get("draft") and many else "")
            same = r.get("same_tokens")
            out.append("| " + " | ".join([
                r["request_class"], method, str(r["k"]) if r["k"] else "-", f"{r['tok_s']:.1f}", f"{r['speedup']:.2f}x",
                _fmt(r.get("decode_speedup")), _fmt(r.get("alpha")), _fmt(r.get("acceptance")), _fmt(r.get("token_acceptance")),
                _fmt(r.get("mean_accepted_length")), _fmt(r.get("cost_ratio"), ".3f"), _fmt(r.get("verify_cost")),
                _fmt(r.get("bound")),
                _fmt(r.get("efficiency")), "-" if same is None else ("yes" if same else "no")]) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":  # python -m adaptspec.tools.bench RESULT.json
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m adaptspec.tools.bench RESULT.json   (a file `adaptspec bench --json` wrote)")
    print(markdown_report(json.loads(open(sys.argv[1]).read())), end="")
