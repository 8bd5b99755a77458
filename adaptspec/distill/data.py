"""On-policy data: the target's own continuations of the corpus prompts.

The target decodes the prompts with our engine (continuous batching, no speculation) at a
large batch: one greedy continuation per prompt plus ``samples`` sampled ones (temperature
``sample_temperature``), so the data covers both the greedy path the benchmark measures
and the target's spread. Only token ids are stored; the trainer recomputes the target's
features and distributions on the fly, so the data file stays small.

The file (``torch.save``) is appended to as it grows and resumes where it stopped.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from adaptspec.distill.corpus import interleave


@dataclass(slots=True)
class Example:
    ids: list[int]  # prompt + continuation
    prompt_len: int
    request_class: str
    greedy: bool

    @property
    def num_output(self) -> int:
        return len(self.ids) - self.prompt_len


@dataclass(slots=True)
class Dataset:
    examples: list[Example] = field(default_factory=list)
    next_prompt: int = 0  # cursor into the interleaved prompt list (for resume)
    gen_seconds: float = 0.0

    @property
    def output_tokens(self) -> int:
        return sum(e.num_output for e in self.examples)

    def save(self, path: Path) -> None:
        tmp = Path(str(path) + ".tmp")
        torch.save({"examples": [(e.ids, e.prompt_len, e.request_class, e.greedy) for e in self.examples],
                    "next_prompt": self.next_prompt, "gen_seconds": self.gen_seconds}, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "Dataset":
        raw = torch.load(path, weights_only=False)
        return cls([Example(list(i), p, c, g) for i, p, c, g in raw["examples"]], raw["next_prompt"],
                   raw.get("gen_seconds", 0.0))


def generate(engine, prompts: dict[str, list[str]], path: Path | None, *, tokens: int,
             time_budget_s: float | None = None, max_new_tokens: int = 192, max_prompt_tokens: int = 384,
             samples: int = 1, sample_temperature: float = 0.8, seed: int = 0,
             console: Console | None = None, label: str = "on-policy data",
             order: list[tuple[str, str]] | None = None) -> Dataset:
    """Decode until ``tokens`` continuation tokens exist (or the time budget ends).

    ``order``: the (class, prompt) pairs in the order to decode them (default: the
    classes of ``prompts`` round-robin); resuming needs the same order."""
    from adaptspec.engine.params import SamplingParams, SpecConfig

    con = console or Console()
    data = Dataset.load(path) if path is not None and path.is_file() else Dataset()
    pairs = order if order is not None else interleave(prompts)
    jobs = [(c, p, s) for c, p in pairs for s in range(1 + samples)]  # s == 0: greedy
    spec = SpecConfig("none", 0)
    start, last_save = time.perf_counter(), time.perf_counter()
    base_tokens = data.output_tokens
    inflight: dict[str, tuple[str, int, bool]] = {}
    cursor = data.next_prompt
    cap = engine.config.max_num_seqs
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,} tok"),
                  TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                  console=con, transient=False) as prog:
        task = prog.add_task(label, total=tokens, completed=min(base_tokens, tokens), rate="")
        while True:
            done_enough = data.output_tokens >= tokens
            out_of_time = time_budget_s is not None and time.perf_counter() - start > time_budget_s
            while not (done_enough or out_of_time) and len(inflight) < cap and cursor < len(jobs):
                cls, prompt, s = jobs[cursor]
                cursor += 1
                ids = engine.encode(prompt)
                if len(ids) > max_prompt_tokens:
                    continue
                params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0 if s == 0 else sample_temperature,
                                        seed=seed * 1_000_003 + cursor)
                rid = engine.add_request(ids, params, spec, request_class=cls)
                inflight[rid] = (cls, len(ids), s == 0)
            if not inflight:
                break
            if done_enough or out_of_time:  # stop: keep what finished, drop partial continuations
                for rid in list(inflight):
                    engine.abort(rid)
                inflight.clear()
                break
            for out in engine.step():
                if out.finished and out.request_id in inflight:
                    cls, plen, greedy = inflight.pop(out.request_id)
                    data.examples.append(Example(out.prompt_token_ids + out.token_ids, plen, cls, greedy))
            data.next_prompt = cursor - len(inflight)  # conservative: resume re-decodes in-flight prompts
            elapsed = time.perf_counter() - start
            produced = data.output_tokens - base_tokens
            prog.update(task, completed=min(data.output_tokens, tokens),
                        rate=f"{produced / max(elapsed, 1e-9):,.0f} tok/s")
            if path is not None and time.perf_counter() - last_save > 60:
                data.gen_seconds += time.perf_counter() - last_save
                data.save(path)
                last_save = time.perf_counter()
    data.gen_seconds += time.perf_counter() - last_save
    if path is not None:
        data.save(path)
    return data
