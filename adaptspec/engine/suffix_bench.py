"""A workload with repeated structure across requests, and the suffix drafter measured on it.

Two request classes, each made from one template filled with random values (seeded):

* ``extraction``: a short record written as prose ("Maria Lopez is a 34-year-old nurse
  from Lyon ...") and the instruction to return it as JSON with fixed keys;
* ``tool_call``: an agent turn: a fixed tool list, a user question, and the instruction to
  answer with one tool call in a fixed JSON format.

Answers of one class share their scaffolding (keys, quoting, the call syntax) and differ
in the values, which come from the request's own prompt: the case the suffix drafter is
for (its class store drafts the scaffolding, its own-prompt index the values), and prompt
lookup only half covers.

    python -m adaptspec.engine.suffix_bench --requests 40 --k 8 --json out.json

Every method runs the same prompts in the same order, interleaved chunk by chunk (the
engine hands every finished request to every drafter; here the suffix drafter keeps only
the outputs of its own runs, or its store would hold the other methods' answers to the
very same prompts). Requests run ``--batch`` at a time, so a request's class store holds
the outputs of the requests before it.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass

FIRST = ["Maria", "James", "Aiko", "Omar", "Lena", "Carlos", "Priya", "Tom", "Sofia", "Ivan", "Grace", "Kofi",
         "Elena", "Noah", "Mei", "Lucas", "Amara", "Felix", "Hana", "Diego"]
LAST = ["Lopez", "Smith", "Tanaka", "Haddad", "Novak", "Silva", "Patel", "Brown", "Rossi", "Petrov", "Kim",
        "Mensah", "Garcia", "Muller", "Chen", "Dubois", "Okafor", "Berg", "Sato", "Reyes"]
CITIES = ["Lyon", "Osaka", "Cairo", "Denver", "Porto", "Leeds", "Pune", "Graz", "Quito", "Perth", "Oslo", "Accra"]
JOBS = ["nurse", "teacher", "pilot", "chef", "architect", "lawyer", "engineer", "baker", "librarian", "dentist"]
HOBBIES = ["chess", "cycling", "painting", "gardening", "climbing", "baking", "photography", "sailing"]
TOOLS = (
    "get_weather(city: str, unit: 'celsius' | 'fahrenheit')\n"
    "search_flights(origin: str, destination: str, date: str)\n"
    "convert_currency(amount: float, source: str, target: str)\n"
    "set_reminder(text: str, time: str)"
)
QUESTIONS = [
    ("What's the weather like in {c1} right now, in celsius?", "get_weather"),
    ("Find me a flight from {c1} to {c2} on {date}.", "search_flights"),
    ("How much is {amt} {cur1} in {cur2}?", "convert_currency"),
    ("Remind me to {task} at {hour}.", "set_reminder"),
]
TASKS = ["call my mother", "water the plants", "submit the report", "book a dentist appointment", "buy milk"]
CURRENCIES = ["USD", "EUR", "JPY", "GBP", "CHF", "INR"]


@dataclass(slots=True)
class Request:
    request_class: str
    prompt: str  # the user's message
    prefix: str = ""  # the start of the assistant's turn, given (as agent frameworks do)

    def text(self, tokenizer) -> str:
        """The prompt in the target's chat template, the assistant's turn begun with ``prefix``."""
        return tokenizer.apply_chat_template([{"role": "user", "content": self.prompt}], add_generation_prompt=True,
                                             tokenize=False) + self.prefix


def _extraction(rng: random.Random) -> Request:
    name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    age, city, job, hobby = rng.randint(21, 70), rng.choice(CITIES), rng.choice(JOBS), rng.choice(HOBBIES)
    email = f"{name.split()[0].lower()}.{name.split()[1].lower()}@example.com"
    text = (f"{name} is a {age}-year-old {job} from {city}. In their free time they enjoy {hobby}. "
            f"You can reach them at {email}.")
    return Request("extraction", "Extract the person's details from the text below and return only a JSON object "
                                 "with the keys \"name\", \"age\", \"city\", \"occupation\", \"hobby\" and \"email\".\n\n"
                                 f"Text: {text}")


def _tool_call(rng: random.Random) -> Request:
    q, _ = rng.choice(QUESTIONS)
    c1, c2 = rng.sample(CITIES, 2)
    question = q.format(c1=c1, c2=c2, date=f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                        amt=rng.randint(5, 900), cur1=rng.choice(CURRENCIES), cur2=rng.choice(CURRENCIES),
                        task=rng.choice(TASKS), hour=f"{rng.randint(6, 21)}:{rng.choice(['00', '15', '30', '45'])}")
    return Request("tool_call", "You are an assistant that can call these tools:\n"
                                f"{TOOLS}\n\n"
                                "Answer the user with exactly one tool call, written as JSON: "
                                "{\"tool\": <name>, \"arguments\": {<argument>: <value>, ...}}.\n\n"
                                f"User: {question}", prefix="Call: {\"tool\": \"")


def structured_prompts(n: int, seed: int = 0, classes: tuple[str, ...] = ("extraction", "tool_call")) -> list[Request]:
    """``n`` requests, the classes alternating; deterministic for a seed."""
    rng = random.Random(seed)
    make = {"extraction": _extraction, "tool_call": _tool_call}
    for c in classes:
        if c not in make:
            raise ValueError(f"classes: unknown class {c!r} (extraction, tool_call)")
    return [make[classes[i % len(classes)]](rng) for i in range(n)]


@dataclass(slots=True)
class MethodResult:
    request_class: str
    method: str  # plain | ngram | suffix
    k: int
    requests: int
    tokens: int
    steps: int
    drafted: int
    accepted: int
    wall_s: float
    mean_accepted_length: float  # tokens emitted per decode step
    acceptance: float  # accepted / drafted
    same_tokens: bool | None
    second_half_accepted_length: float  # the later requests only (the class store warm)
    outputs: list | None = None  # plain: each request's prompt and output token ids (for ``simulate``)


class _OwnRequestsOnly:
    """The suffix drafter as the engine sees it, learning only from the requests that used
    it: plain and n-gram runs of the same prompts (interleaved with its own) stay out of
    its class store."""

    name, wants_features = "suffix", False

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, attr):  # propose, on_verified, on_admit, observe, ... go to the drafter
        return getattr(self.inner, attr)

    def release(self, seq) -> None:
        if seq.spec.drafter == "suffix":
            self.inner.release(seq)
        else:
            self.inner._own.pop(id(seq), None)


def measure(target: str = "smollm2-135m", dtype: str = "bfloat16", requests: int = 40, k: int = 8,
            max_new_tokens: int = 96, batch: int = 1, seed: int = 0, methods=("plain", "ngram", "suffix"),
            suffix_options: dict | None = None) -> list[MethodResult]:
    """Every method over the same requests in the same order, interleaved chunk by chunk
    (the first method rotating), so that a change of the machine's speed hits every method
    alike; the suffix drafter's store holds its own earlier outputs only."""
    from adaptspec import Engine, SamplingParams, SpecConfig
    from adaptspec.engine.suffix import SuffixProposer

    reqs = structured_prompts(requests, seed)
    eng = Engine.from_pretrained(target, dtype=dtype, max_num_seqs=batch, max_model_len=1024)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    eng.generate(["warm up"], SamplingParams(max_new_tokens=4))
    prop = _OwnRequestsOnly(SuffixProposer(**(suffix_options or {})))
    if hasattr(eng, "add_proposer"):
        eng.add_proposer("suffix", prop)
    else:
        eng.proposers["suffix"] = prop
    outs = {m: [] for m in methods}
    wall = {m: 0.0 for m in methods}
    for c, i in enumerate(range(0, len(reqs), batch)):
        chunk = reqs[i:i + batch]
        for method in methods[c % len(methods):] + methods[:c % len(methods)]:
            spec = SpecConfig("none", 0) if method == "plain" else SpecConfig(method, k)
            t0 = time.perf_counter()
            outs[method] += eng.generate([r.text(eng.tokenizer) for r in chunk], params, spec, raw=True,
                                         request_class=[r.request_class for r in chunk])
            wall[method] += time.perf_counter() - t0
    results, plain_out = [], {}
    for method in methods:
        o = outs[method]
        for cls in sorted({r.request_class for r in reqs}):
            idx = [i for i, r in enumerate(reqs) if r.request_class == cls]
            st = [o[i].stats for i in idx]
            toks = [o[i].token_ids for i in idx]
            half = idx[len(idx) // 2:]
            h_emit = sum(o[i].stats.emitted for i in half)
            h_steps = sum(o[i].stats.steps for i in half)
            if method == "plain":
                plain_out[cls] = toks
            steps, emitted = sum(x.steps for x in st), sum(x.emitted for x in st)
            drafted, accepted = sum(x.drafted for x in st), sum(x.accepted for x in st)
            results.append(MethodResult(cls, method, 0 if method == "plain" else k, len(idx),
                                        sum(len(t) for t in toks), steps, drafted, accepted,
                                        wall[method] * len(idx) / len(reqs), emitted / max(steps, 1),
                                        accepted / max(drafted, 1),
                                        None if method == "plain" or cls not in plain_out else toks == plain_out[cls],
                                        h_emit / max(h_steps, 1),
                                        [(o[i].prompt_token_ids, o[i].token_ids) for i in idx]
                                        if method == "plain" else None))
    return results


def simulate(prompts: list[list[int]], outputs: list[list[int]], classes: list[str], drafter: str, k: int,
             max_new_tokens: int, suffix_options: dict | None = None) -> dict[str, dict]:
    """Greedy speculative decoding replayed without the model: each request's output is
    the target's greedy answer (every drafter is exact, so it is the same for any drafter),
    a step drafts from the tokens committed so far, keeps the leading candidates that match
    the answer plus one token; requests run one after another and each finished output
    joins its class's store (what the engine does at batch 1). Per class: steps, emitted,
    drafted, accepted."""
    from adaptspec.engine.proposers import NgramProposer
    from adaptspec.engine.suffix import SuffixProposer, TokenIndex

    ngram = NgramProposer(3, 1)
    suf = SuffixProposer(**(suffix_options or {}))
    res: dict[str, dict] = {}
    for prompt, out, cls in zip(prompts, outputs, classes):
        tot = res.setdefault(cls, {"steps": 0, "emitted": 0, "drafted": 0, "accepted": 0})
        seq = list(prompt) + out[:1]  # the prefill emits the first token (not a decode step)
        own = TokenIndex()
        done = 1
        while done < len(out):
            kk = min(k, max_new_tokens - done - 1)  # the engine's cap; an answer that ended early stops matching
            if drafter == "ngram":
                cand = ngram.lookup(seq, kk)
            else:
                own.extend(seq[own.n:])
                cand = suf.draft(own, cls, kk)[0]
            a = 0
            while a < len(cand) and done + a < len(out) and cand[a] == out[done + a]:
                a += 1
            n = min(a + 1, len(out) - done)
            a = min(a, n)
            seq += out[done:done + n]
            done += n
            tot["steps"] += 1
            tot["emitted"] += n
            tot["drafted"] += len(cand)
            tot["accepted"] += a
        suf.observe_output(cls, out)
    return res


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res = measure(a.target, a.dtype, a.requests, a.k, a.max_new_tokens, a.batch, a.seed)
    print(f"{'class':<11} {'method':<7} {'k':>2} {'tok':>5} {'steps':>5} {'acc.len':>7} {'2nd half':>8} "
          f"{'acc.rate':>8} {'tok/s':>6} exact")
    for r in res:
        print(f"{r.request_class:<11} {r.method:<7} {r.k:>2} {r.tokens:>5} {r.steps:>5} {r.mean_accepted_length:>7.2f} "
              f"{r.second_half_accepted_length:>8.2f} {r.acceptance:>8.2f} {r.tokens / r.wall_s:>6.1f} "
              f"{'-' if r.same_tokens is None else ('yes' if r.same_tokens else 'no')}")
    for cls in sorted({r.request_class for r in res}):
        by = {r.method: r for r in res if r.request_class == cls}
        if "ngram" in by and "suffix" in by:
            print(f"{cls}: suffix / ngram accepted length = "
                  f"{by['suffix'].mean_accepted_length / by['ngram'].mean_accepted_length:.2f}x")
    if a.json:
        import torch

        meta = {"target": a.target, "dtype": a.dtype, "requests": a.requests, "k": a.k,
                "max_new_tokens": a.max_new_tokens, "batch": a.batch, "seed": a.seed, "torch": torch.__version__,
                "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d")}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in res]}, f, indent=1)


if __name__ == "__main__":
    main()
