"""Disaggregated placement: the draft model in its own Drafter replicas.

A TargetEngine replica gets a ``RemoteDraftProposer`` in place of the co-located draft
model: each step it sends the drafting requests' token ids to a Drafter replica and gets
the candidates (and ``q`` for sampled requests) back. The Drafter keeps its own KV cache
with a mirror per request, so only tokens it has not fed yet are computed: the mirror
remembers which token sits at each KV position it filled (real or drafted), and on every
call keeps the longest prefix that still matches the target's tokens. A miss (another
replica, an evicted mirror) costs a catch-up prefill, never a wrong token. Calls are
synchronous from the engine thread with a timeout; an error or timeout means k = 0
(``GuardedProposer``). The engine thread hands each call to the replica's event loop and
waits for it there: the handle's router may run on that loop (Serve's
``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0``, which the service sets), where a blocking call
from another thread would never be routed.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import zlib
from dataclasses import dataclass, field

from ray import serve

from adaptspec.engine.params import SamplingParams
from adaptspec.engine.proposers import Proposer
from adaptspec.serve.config import ServiceConfig


@dataclass(slots=True)
class DraftItem:
    key: str  # "<target replica>/<request id>": the mirror's name
    token_ids: list[int]  # the request's prompt + output so far
    k: int
    params: SamplingParams


@dataclass(slots=True)
class DraftJob:
    items: list[DraftItem]
    releases: list[str] = field(default_factory=list)  # mirrors to drop


@dataclass(slots=True)
class DraftReply:
    token_ids: list[list[int]]
    probs: list  # per item: torch.Tensor [n, vocab_size] or None (one-hot)


class DraftService:
    """Ray-free core: mirrors, slots (LRU eviction), the draft-model proposer."""

    BLOCK_SIZE = 16

    def __init__(self, model, num_slots: int, max_len: int):
        from adaptspec.engine.proposers import DraftModelProposer

        # each mirror owns a fixed run of blocks (its "slot"): mirrors never share KV here
        self.blocks_per_slot = -(-max_len // self.BLOCK_SIZE)
        model.allocate_kv(num_slots * self.blocks_per_slot, self.BLOCK_SIZE)
        self.proposer = DraftModelProposer(model)
        self.free = list(range(num_slots - 1, -1, -1))
        self.mirrors: collections.OrderedDict = collections.OrderedDict()  # key -> (Sequence, fed tokens)
        self.lock = threading.Lock()

    def propose(self, job: DraftJob) -> DraftReply:
        with self.lock:
            for key in job.releases:
                self._drop(key)
            seqs = [self._sync(item) for item in job.items]
            drafts = self.proposer.propose(seqs, [i.k for i in job.items])
            for item, seq, d in zip(job.items, seqs, drafts):
                # what now sits in KV positions [0, draft_computed): real tokens, then fed candidates
                self.mirrors[item.key] = (seq, (seq.token_ids + d.token_ids)[:seq.draft_computed],
                                          seq.block_table[0] // self.blocks_per_slot)
            return DraftReply([d.token_ids for d in drafts], [d.probs for d in drafts])

    def _sync(self, item: DraftItem):
        import torch

        from adaptspec.engine.params import SpecConfig
        from adaptspec.engine.sequence import Sequence, Status

        entry = self.mirrors.pop(item.key, None)
        if entry is None:
            if not self.free:
                self._drop(next(iter(self.mirrors)))  # least recently used
            gen = torch.Generator()
            gen.manual_seed(item.params.seed if item.params.seed is not None else zlib.crc32(item.key.encode()))
            slot = self.free.pop()
            seq = Sequence(item.key, list(item.token_ids), len(item.token_ids), item.params, SpecConfig(), "", gen,
                           status=Status.RUNNING)
            n = self.blocks_per_slot
            seq.block_table = list(range(slot * n, (slot + 1) * n))
            fed: list[int] = []
        else:
            seq, fed, slot = entry
        n = 0
        limit = min(len(fed), len(item.token_ids))
        while n < limit and fed[n] == item.token_ids[n]:
            n += 1
        seq.draft_computed = min(seq.draft_computed, n)
        seq.token_ids, seq.params = list(item.token_ids), item.params
        self.mirrors[item.key] = (seq, fed, slot)
        return seq

    def _drop(self, key: str) -> None:
        entry = self.mirrors.pop(key, None)
        if entry is not None:
            self.free.append(entry[2])


class RemoteDraftProposer(Proposer):
    """The target-side stand-in for the draft model (an engine ``Proposer``)."""

    name = "draft"

    def __init__(self, handle, replica_id: str, loop: asyncio.AbstractEventLoop, timeout_s: float = 5.0):
        self.handle, self.replica_id, self.loop, self.timeout_s = handle, replica_id, loop, timeout_s
        self.releases: list[str] = []

    async def _call(self, job: "DraftJob") -> "DraftReply":
        return await self.handle.propose.remote(job)

    def propose(self, seqs, ks):
        from adaptspec.engine.proposers import Draft

        job = DraftJob([DraftItem(f"{self.replica_id}/{s.request_id}", list(s.token_ids), k, s.params)
                        for s, k in zip(seqs, ks)], self.releases)
        self.releases = []
        fut = asyncio.run_coroutine_threadsafe(self._call(job), self.loop)
        try:
            reply: DraftReply = fut.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"Drafter did not answer within {self.timeout_s} s") from None
        return [Draft(ids, p) for ids, p in zip(reply.token_ids, reply.probs)]

    def on_verified(self, seq, num_tokens_before, num_accepted, hidden=None) -> None:
        pass  # the Drafter re-syncs from the token ids it gets next step

    def release(self, seq) -> None:
        self.releases.append(f"{self.replica_id}/{seq.request_id}")


@serve.deployment(name="Drafter", max_ongoing_requests=64)
class Drafter:
    async def __init__(self, config: dict):
        import asyncio

        import torch

        from adaptspec.models.loader import load_model

        cfg = ServiceConfig.model_validate(config)
        torch.set_num_threads(max(1, int(cfg.drafter.num_cpus or 1)))
        loaded = await asyncio.to_thread(load_model, cfg.models.draft, dtype=cfg.models.dtype,
                                         device=cfg.models.device, quiet=True)
        cap = min(cfg.engine.max_model_len, loaded.model.cfg.max_position)
        self.core = DraftService(loaded.model, cfg.engine.max_num_seqs * cfg.target.num_replicas, cap)

    def propose(self, job: DraftJob) -> DraftReply:
        return self.core.propose(job)
