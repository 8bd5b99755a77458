"""The target's features for head training, computed once by teacher-forced prefills and
stored as shards.

Per token position ``t`` of a sequence a shard keeps:

* ``aux`` [T, nF * H] bfloat16: the head's input feature, the concatenation in
  ``feature_layers`` order of transformers' ``hidden_states[i][t]`` (``HeadConfig``
  defines it; an empty list stores the final normed hidden state instead);
* ``final`` [T, H] float16: the target's final normed hidden state (its logits are
  ``final @ W_out``: the trainer recomputes the draft-vocabulary part);
* ``lse`` [T] float32, ``argmax`` [T] int32: log-sum-exp and argmax of the target's full
  logits where ``loss`` is set (0 elsewhere), so the target's probability of draft-vocabulary
  token ``v`` is ``exp(final . W_out[v] - lse)`` with no full-vocabulary product in training;
* ``loss`` [T] uint8: position ``t`` predicts a token to learn (an answer token);
* ``ids`` [T] int32 and ``offsets`` [n + 1] int64 (sequence boundaries).

The manifest (``manifest.json``) lists the shards with each sequence's class and how many
items of each source were consumed, so an interrupted extraction resumes where it stopped.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

MANIFEST = "manifest.json"


@dataclass(slots=True)
class Item:
    """A sequence to prefill: token ids, the positions to learn (``loss[t]``: t predicts
    ids[t + 1]) and its class."""

    ids: list[int]
    loss: list[bool]
    request_class: str


class FeatureStore:
    """A folder of shards plus a manifest; appends resume from ``consumed``."""

    def __init__(self, folder: Path, meta: dict | None = None):
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        if path.is_file():
            self.manifest = json.loads(path.read_text())
            if meta:
                mine = {k: self.manifest.get("meta", {}).get(k) for k in meta}
                if mine != meta:
                    raise ValueError(f"features: {self.folder} was made with {mine}, not {meta}; "
                                     "use another run folder")
        else:
            self.manifest = {"meta": meta or {}, "shards": [], "consumed": {}}

    @property
    def shards(self) -> list[dict]:
        return self.manifest["shards"]

    def consumed(self, source: str) -> int:
        return int(self.manifest["consumed"].get(source, 0))

    @property
    def loss_tokens(self) -> int:
        return sum(s["loss_tokens"] for s in self.shards)

    def loss_tokens_of(self, source: str) -> int:
        return sum(s["loss_tokens"] for s in self.shards if s.get("source") == source)

    def add(self, tensors: dict[str, torch.Tensor], classes: list[str], source: str, consumed: int) -> None:
        from safetensors.torch import save_file

        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"shard_{len(self.shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(self.folder / name))
        off = tensors["offsets"]
        self.shards.append({"file": name, "source": source, "sequences": len(classes), "classes": classes,
                            "lengths": (off[1:] - off[:-1]).tolist(),
                            "tokens": int(tensors["ids"].numel()), "loss_tokens": int(tensors["loss"].sum())})
        self.manifest["consumed"][source] = consumed
        self._write()

    def _write(self) -> None:
        tmp = self.folder / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(self.manifest, indent=0) + "\n")
        tmp.replace(self.folder / MANIFEST)

    def load(self, i: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(self.folder / self.shards[i]["file"]))

    def sequences(self, i: int) -> Iterator[tuple[dict[str, torch.Tensor], str]]:
        """Shard ``i``'s sequences, each as its own tensors (views) and class."""
        sh = self.load(i)
        off = sh["offsets"].tolist()
        for r, cls in enumerate(self.shards[i]["classes"]):
            a, b = off[r], off[r + 1]
            yield {k: v[a:b] for k, v in sh.items() if k != "offsets"}, cls


class Teacher:
    """The target in transformers: hidden states of every layer by one prefill."""

    def __init__(self, folder: Path, dtype: torch.dtype, feature_layers: list[int], device="cpu"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        self.layers = list(feature_layers)
        n = self.model.config.num_hidden_layers
        if any(not 0 <= i <= n for i in self.layers):
            raise ValueError(f"feature_layers: the target has hidden states 0..{n}, got {self.layers}")
        self.out_weight = self.model.get_output_embeddings().weight.float()  # [vocab, H], fp32 for lse / argmax
        self.device = torch.device(device)

    @torch.inference_mode()
    def run(self, items: list[Item]) -> list[dict[str, torch.Tensor]]:
        """One padded prefill of ``items``; per item its shard tensors (without offsets)."""
        L = max(len(x.ids) for x in items)
        ids = torch.zeros(len(items), L, dtype=torch.long)
        mask = torch.zeros(len(items), L, dtype=torch.long)
        for r, x in enumerate(items):
            ids[r, :len(x.ids)] = torch.tensor(x.ids)
            mask[r, :len(x.ids)] = 1
        out = self.model.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                               output_hidden_states=True)
        hs = out.hidden_states
        final = out.last_hidden_state  # normed
        aux = torch.cat([hs[i] for i in self.layers], -1) if self.layers else final
        res = []
        for r, x in enumerate(items):
            n = len(x.ids)
            loss = torch.tensor(x.loss, dtype=torch.bool)
            f = final[r, :n].float()
            lse = torch.zeros(n)
            arg = torch.zeros(n, dtype=torch.int32)
            if loss.any():
                logits = f[loss.to(f.device)] @ self.out_weight.t()  # [m, vocab]
                lse[loss] = torch.logsumexp(logits, -1).cpu()
                arg[loss] = logits.argmax(-1).to(torch.int32).cpu()
            res.append({"ids": torch.tensor(x.ids, dtype=torch.int32), "aux": aux[r, :n].to(torch.bfloat16).cpu(),
                        "final": f.to(torch.float16).cpu(), "lse": lse, "argmax": arg,
                        "loss": loss.to(torch.uint8)})
        return res


def _concat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    lens = torch.tensor([0] + [p["ids"].numel() for p in parts])
    out["offsets"] = torch.cumsum(lens, 0).to(torch.int64)
    return out


def extract(store: FeatureStore, teacher: Teacher, sources: dict[str, Iterable[Item]], budgets: dict[str, int],
            *, shard_tokens: int = 16384, batch_tokens: int = 2048, label: str = "features") -> FeatureStore:
    """Prefill items of each source until its budget of loss tokens is in the store,
    alternating sources shard by shard; resumes after the items the manifest consumed."""
    from tqdm import tqdm

    total = sum(budgets.values())
    iters = {}
    for s, it in sources.items():
        it = iter(it)
        for _ in range(store.consumed(s)):  # the items earlier runs stored (or skipped)
            next(it, None)
        iters[s] = it
    done = {s: store.loss_tokens_of(s) for s in sources}
    pos = {s: store.consumed(s) for s in sources}
    bar = tqdm(total=total, initial=min(total, sum(done.values())), desc=label, unit="tok", smoothing=0.05)
    t0, new = time.perf_counter(), 0
    active = [s for s in sources if done[s] < budgets.get(s, 0)]
    while active:
        for s in list(active):
            parts, classes, n_tok, got, exhausted = [], [], 0, 0, False
            while n_tok < shard_tokens and done[s] + got < budgets[s] and not exhausted:
                batch: list[Item] = []
                while sum(len(x.ids) for x in batch) < batch_tokens and len(batch) < 64:
                    item = next(iters[s], None)
                    if item is None:
                        exhausted = True
                        break
                    pos[s] += 1
                    if any(item.loss):
                        batch.append(item)
                if not batch:
                    break
                res = teacher.run(batch)
                parts += res
                classes += [x.request_class for x in batch]
                n_tok += sum(len(x.ids) for x in batch)
                k = sum(int(p["loss"].sum()) for p in res)
                got += k
                new += k
                bar.update(k)
                bar.set_postfix(tok_s=f"{new / max(time.perf_counter() - t0, 1e-9):.0f}")
            if parts:
                store.add(_concat(parts), classes, s, pos[s])
                done[s] += got
            else:
                store.manifest["consumed"][s] = pos[s]
                store._write()
            if exhausted or done[s] >= budgets[s]:
                active.remove(s)
    bar.close()
    return store


# ---- items ------------------------------------------------------------------------------
def onpolicy_items(examples) -> Iterator[Item]:
    """``data.Example``s: learn the answer (position t predicts ids[t + 1] for t >= prompt_len - 1)."""
    for e in examples:
        n = len(e.ids)
        yield Item(list(e.ids), [e.prompt_len - 1 <= t < n - 1 for t in range(n)], e.request_class)


def conversation_items(convs, tokenizer, max_len: int, request_class: str = "sharegpt") -> Iterator[Item]:
    """Whole conversations in the target's chat template, the assistant turns' text (with
    what the template appends after it, e.g. the end-of-turn token) to learn; the first
    ``max_len`` tokens of each. Each turn is the template's text for the conversation up to
    that turn less its text up to the previous one (chat templates render prefixes stably)."""
    for c in convs:
        msgs, prev, ids, learn = [], "", [], []
        for role, text in c.turns:
            msgs.append({"role": role, "content": text})
            full = tokenizer.apply_chat_template(msgs, tokenize=False)
            if not full.startswith(prev):
                break
            piece, prev = full[len(prev):], full
            cut = piece.find(text)
            head, body = (piece, "") if cut < 0 else (piece[:cut], piece[cut:])
            h = tokenizer(head, add_special_tokens=False)["input_ids"] if head else []
            b = tokenizer(body, add_special_tokens=False)["input_ids"] if body else []
            ids += h + b
            learn += [False] * len(h) + [role == "assistant"] * len(b)
            if len(ids) >= max_len:
                break
        ids, learn = ids[:max_len], learn[:max_len]
        if len(ids) < 2:
            continue
        yield Item(ids, learn[1:] + [False], request_class)  # t learns when it predicts an assistant token
