"""Paged KV-cache bookkeeping: per-request block lists over the BlockPool
(core/block_pool.py), with optional prefix caching.

Owner of all block state. Never touches tensors: the ModelRunner maps block ids
to K/V storage. Block states (free / cached / held) are described in
core/block_pool.py.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from formwork.core.block_pool import BlockHash, BlockPool, HashFn, hash_block_tokens
from formwork.core.request import Request


@dataclass(slots=True)
class _ReqBlocks:
    block_ids: list[int] = field(default_factory=list)
    num_hashed: int = 0                 # leading blocks already hash-registered (or skipped)
    last_hash: BlockHash | None = None  # chain hash of block num_hashed - 1


def chain_root(req: Request) -> BlockHash | None:
    """The parent of a request's first block in the hash chain: None, or a digest of
    its `cache_salt` (vLLM's), so that requests with different salts never share a
    cached block (no prefix-cache timing side channel between tenants) and requests
    with the same salt share as usual."""
    salt = req.sampling_params.cache_salt
    if salt is None:
        return None
    return hashlib.blake2b(b"cache_salt\0" + salt.encode("utf-8"), digest_size=16).digest()


class KVCacheManager:
    """Per-request block lists over a BlockPool, with optional prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 *, hash_fn: HashFn = hash_block_tokens) -> None:
        assert block_size >= 1, block_size
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._hash_fn = hash_fn
        self._reqs: dict[str, _ReqBlocks] = {}
        self.prefix_cache_queries = 0   # tokens looked up
        self.prefix_cache_hits = 0      # tokens found

    # ---- queries -------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free and unhashed (cached ref-0 blocks are counted in num_cached_blocks)."""
        return self.pool.num_allocatable() - self.pool.num_free_cached

    @property
    def num_cached_blocks(self) -> int:
        """Ref-0 blocks that still hold a prefix-cache entry (evictable)."""
        return self.pool.num_free_cached

    @property
    def num_allocatable_blocks(self) -> int:
        return self.pool.num_allocatable()

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - self.pool.num_allocatable() / self.pool.num_blocks

    def get_block_ids(self, req_id: str) -> list[int]:
        rb = self._reqs.get(req_id)
        return list(rb.block_ids) if rb is not None else []

    def holds(self, req_id: str) -> bool:
        return req_id in self._reqs

    def req_ids(self) -> set[str]:
        return set(self._reqs)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks; leaves >= 1 token to compute.

        Does not touch the blocks (allocate_slots does). Returns (block_ids, num_tokens).
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        tokens = req.all_token_ids
        hits: list[int] = []
        parent = chain_root(req)
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = self._hash_fn(parent, chunk)
            block = self.pool.lookup(h, parent, chunk)
            if block is None:
                break
            hits.append(block.block_id)
            parent = h
        self.prefix_cache_queries += len(tokens)
        self.prefix_cache_hits += len(hits) * bs
        return hits, len(hits) * bs

    # ---- allocation ----------------------------------------------------
    def num_blocks_to_allocate(self, req: Request, num_new_tokens: int,
                               computed_block_ids: list[int] | None = None) -> int:
        """Fresh blocks allocate_slots would pop (counting touched ref-0 prefix blocks)."""
        computed = computed_block_ids or []
        rb = self._reqs.get(req.request_id)
        held = len(rb.block_ids) if rb is not None else 0
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        fresh = max(0, self.num_blocks_for(total) - held - len(computed))
        revived = sum(1 for b in computed if self.pool.blocks[b].ref_cnt == 0)
        return fresh + revived

    def can_allocate(self, req: Request, num_new_tokens: int,
                     computed_block_ids: list[int] | None = None) -> bool:
        need = self.num_blocks_to_allocate(req, num_new_tokens, computed_block_ids)
        return need <= self.pool.num_allocatable()

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_block_ids: list[int] | None = None) -> list[int] | None:
        """Blocks for num_computed (+ prefix hit) + num_new_tokens tokens.

        Returns the freshly allocated block ids (maybe []), or None, changing
        nothing, when the free queue is too short. The prefix blocks are appended
        to the request's list too (see get_block_ids).
        """
        computed = computed_block_ids or []
        rid = req.request_id
        if not self.can_allocate(req, num_new_tokens, computed):
            return None
        rb = self._reqs.get(rid)
        if rb is None:
            rb = self._reqs[rid] = _ReqBlocks(last_hash=chain_root(req))
        assert not computed or not rb.block_ids, f"{rid}: prefix blocks given to a request holding blocks"
        for block_id in computed:
            self.pool.touch(block_id)
        if computed:
            rb.block_ids.extend(computed)
            rb.num_hashed = len(computed)
            rb.last_hash = self.pool.blocks[computed[-1]].block_hash
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        new = self.pool.pop_free(max(0, self.num_blocks_for(total) - len(rb.block_ids)))
        rb.block_ids.extend(new)
        return new

    def cache_full_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Hash-register every block now full of computed tokens (not yet hashed)."""
        rb = self._reqs.get(req.request_id)
        if not self.enable_prefix_caching or rb is None:
            return
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(rb.block_ids))
        if num_full <= rb.num_hashed:
            return
        tokens = req.token_ids_slice(rb.num_hashed * bs, num_full * bs)
        for i in range(rb.num_hashed, num_full):
            off = (i - rb.num_hashed) * bs
            chunk = tuple(tokens[off:off + bs])
            h = self._hash_fn(rb.last_hash, chunk)
            block = self.pool.blocks[rb.block_ids[i]]
            if block.block_hash is None:
                self.pool.register(block.block_id, h, rb.last_hash, chunk)
            else:
                assert block.block_hash == h, f"block {block.block_id}: hashed with another chain"
            rb.last_hash = h
        rb.num_hashed = num_full

    def free(self, req: Request) -> None:
        """Release all blocks of req, tail blocks first into the free queue."""
        rb = self._reqs.pop(req.request_id, None)
        assert rb is not None, f"free({req.request_id}): holds no blocks (double free?)"
        self.pool.release(list(reversed(rb.block_ids)))

    def reset_prefix_cache(self) -> bool:
        """Drop every hash; refused (False) while any block is held."""
        if self.pool.num_allocatable() != self.pool.num_blocks:
            return False
        self.pool.reset_hashes()
        return True

    # ---- integrity -----------------------------------------------------
    def check_invariants(self) -> None:
        pool = self.pool
        refs = [0] * pool.num_blocks
        for rid, rb in self._reqs.items():
            assert len(set(rb.block_ids)) == len(rb.block_ids), f"{rid}: duplicate blocks {rb.block_ids}"
            assert rb.num_hashed <= len(rb.block_ids), f"{rid}: num_hashed {rb.num_hashed} > blocks"
            for b in rb.block_ids:
                assert 0 <= b < pool.num_blocks, f"{rid}: bad block id {b}"
                refs[b] += 1
        for block in pool.blocks:
            b = block.block_id
            assert block.ref_cnt == refs[b], f"block {b}: ref_cnt {block.ref_cnt}, held by {refs[b]} requests"
            in_free = b in pool.free_queue
            assert in_free == (block.ref_cnt == 0), f"block {b}: ref_cnt {block.ref_cnt}, in free queue {in_free}"
            if block.block_hash is not None:
                assert pool.hash_to_block.get(block.block_hash) is block, f"block {b}: hash not mapped to it"
                assert block.token_ids is not None and len(block.token_ids) == self.block_size, \
                    f"block {b}: hashed without its {self.block_size} tokens"
        free_cached = sum(pool.blocks[b].block_hash is not None for b in pool.free_queue)
        assert pool.num_free_cached == free_cached, \
            f"num_free_cached {pool.num_free_cached}, counted {free_cached}"
        for h, block in pool.hash_to_block.items():
            assert block.block_hash == h, f"hash map entry for block {block.block_id} has a stale hash"
        assert len(pool.free_queue) <= pool.num_blocks, "free queue longer than the pool"
        assert all(0 <= b < pool.num_blocks for b in pool.free_queue), "bad id in free queue"
        if not self.enable_prefix_caching:
            assert not pool.hash_to_block, "hashes registered with prefix caching disabled"
