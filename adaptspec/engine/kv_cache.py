"""The paged KV cache's bookkeeping: a pool of fixed-size blocks and the prefix cache.

The tensors live with the models (``LlamaModel.allocate_kv``: ``[num_blocks, Hkv,
block_size, D]`` per layer); this module only hands out block ids. A sequence owns a block
table (its blocks in position order); position ``p`` lives in block ``table[p // B]`` at
offset ``p % B``. Target, draft model and draft head index their own pools with the SAME
block ids, so one table serves all three.

Prefix caching: a block whose ``B`` positions all hold committed tokens (never drafted ones
still under verification) is registered under a hash of its tokens and of every token
before it (the parent block's hash). A new request looks its prompt's full blocks up and
shares the longest cached run (reference counts); a block whose count drops to 0 stays
cached and is evicted least-recently-freed first when fresh blocks are needed.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

NO_HASH = b""


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The identity of a full block: its tokens and, through ``parent``, every token before.

    A 16-byte BLAKE2b digest: a collision would hand a request another prompt's KV, so this is
    a cryptographic hash and not Python's ``hash``."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


class BlockPool:
    """Block ids ``0 .. num_blocks - 1`` with reference counts and the prefix-cache map.

    Paired methods: ``can_allocate`` / ``allocate`` / ``free``; ``lookup`` / ``take`` for
    cached blocks; ``register`` when a block fills with committed tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes] = [NO_HASH] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id (referenced or evictable)
        # blocks with no reference, oldest first: plain free ones and evictable cached ones
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hits = self.queries = 0  # prompt tokens found cached / looked up

    # ---- plain blocks ------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that ``allocate`` can hand out now (free or evictable)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a sequence."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (reference count 1), evicting the oldest unreferenced cached ones."""
        if n > len(self.free_queue):
            raise RuntimeError(f"allocate({n}): only {len(self.free_queue)} blocks free (check can_allocate)")
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            h = self.hash_of[b]
            if h:  # evict: its content is about to be overwritten
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.hash_of[b] = NO_HASH
            self.ref_count[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; unreferenced ones join the free queue, tail
        blocks first so that a sequence's later blocks are evicted before its prefix."""
        for b in reversed(blocks):
            if self.ref_count[b] <= 0:
                raise RuntimeError(f"free: block {b} is not allocated (double free)")
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free_queue[b] = None

    # ---- prefix cache ------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest run of ``hashes`` (from the first) that is cached.
        Takes no reference: call ``take`` on what you use."""
        out = []
        if self.enable_prefix_caching:
            for h in hashes:
                b = self.cached.get(h)
                if b is None:
                    break
                out.append(b)
        return out

    def take(self, blocks: list[int]) -> None:
        """One more reference to each (cached) block, reviving evictable ones."""
        for b in blocks:
            if self.ref_count[b] == 0:
                del self.free_queue[b]
            self.ref_count[b] += 1

    def register(self, block: int, h: bytes) -> None:
        """``block`` is full of committed tokens whose chain hash is ``h``."""
        if not self.enable_prefix_caching or self.hash_of[block]:
            return
        if h in self.cached:  # the same content is cached in another block already: keep that one
            return
        self.cached[h] = block
        self.hash_of[block] = h

    def check(self) -> None:
        """Invariants (for tests): every block is free xor referenced; the cache map and the
        blocks' hashes agree."""
        for b in range(self.num_blocks):
            if (self.ref_count[b] == 0) != (b in self.free_queue):
                raise AssertionError(f"block {b}: ref_count {self.ref_count[b]}, in free queue {b in self.free_queue}")
            if self.ref_count[b] < 0:
                raise AssertionError(f"block {b}: negative ref_count")
        for h, b in self.cached.items():
            if self.hash_of[b] != h:
                raise AssertionError(f"cached block {b} has another hash")


class KVCacheManager:
    """Block tables of sequences over one ``BlockPool``.

    A sequence (``engine.sequence.Sequence``) carries ``block_table`` (its block ids),
    ``num_computed`` (positions holding committed KV) and ``block_hashes`` (hashes of its
    leading full committed blocks, registered or not).
    """

    def __init__(self, pool: BlockPool, reuse_margin: int = 0):
        self.pool = pool
        self.block_size = pool.block_size
        # cached blocks left unused at the end of a hit: a draft head's entry at a block's last
        # position depends on the NEXT block's first token, so with a head the last matched
        # block is recomputed (its successor is what matched that token)
        self.reuse_margin = reuse_margin

    def blocks_needed(self, seq, num_positions: int) -> int:
        """Fresh blocks ``seq`` needs so that positions ``0 .. num_positions - 1`` have a block."""
        return max(0, -(-num_positions // self.block_size) - len(seq.block_table))

    def admit(self, seq) -> int:
        """Share the longest cached run of ``seq``'s full blocks (at least one token is left
        to compute: its logits give the next token). Returns the positions reused."""
        B = self.block_size
        tokens = seq.token_ids
        usable = (len(tokens) - 1) // B
        hashes = self._hashes(seq, usable)
        blocks = self.pool.lookup(hashes)
        blocks = blocks[:max(0, len(blocks) - self.reuse_margin)]
        self.pool.queries += len(tokens)
        if blocks:
            self.pool.take(blocks)
            self.pool.hits += len(blocks) * B
        seq.block_table = list(blocks)
        seq.num_computed = len(blocks) * B
        return seq.num_computed

    def can_grow(self, seq, num_positions: int) -> bool:
        return self.pool.can_allocate(self.blocks_needed(seq, num_positions))

    def grow(self, seq, num_positions: int) -> None:
        n = self.blocks_needed(seq, num_positions)
        if n:
            seq.block_table.extend(self.pool.allocate(n))

    def commit(self, seq) -> None:
        """After ``seq.num_computed`` advanced: register the blocks it filled and free the
        tail blocks past the next position to write (those held rejected drafts only)."""
        B = self.block_size
        full = seq.num_computed // B
        if full > seq.num_registered:
            hashes = self._hashes(seq, full)
            for i in range(seq.num_registered, full):
                self.pool.register(seq.block_table[i], hashes[i])
            seq.num_registered = full
        keep = -(-(seq.num_computed + 1) // B)
        if len(seq.block_table) > keep:
            tail = seq.block_table[keep:]
            del seq.block_table[keep:]
            self.pool.free(tail)

    def free(self, seq) -> None:
        if seq.block_table:
            self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_registered = 0

    def _hashes(self, seq, n: int) -> list[bytes]:
        """Hashes of ``seq``'s first ``n`` full blocks (cached on the sequence)."""
        B, hs = self.block_size, seq.block_hashes
        while len(hs) < n:
            i = len(hs)
            hs.append(block_hash(hs[-1] if hs else NO_HASH, seq.token_ids[i * B:(i + 1) * B]))
        return hs[:n]
