"""Paged KV-cache bookkeeping: block ids, ref counts, prefix-cache hashes.

Owner of all block state. Never touches tensors: the ModelRunner maps block ids
to K/V storage. Every block is exactly one of
  free      (ref 0, unhashed, in the free queue)
  cached    (ref 0, hashed, in the free queue: reusable by a prefix hit until
             it is popped for a new allocation, which evicts its hash)
  held      (ref > 0, not in the free queue; hashed or not)
The free queue is LRU: freed blocks go to the tail, allocation pops the head.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from formwork.core.request import Request

BlockHash = Hashable
# hash_fn(parent_hash, block_token_ids) -> hash; the chain makes a block's hash
# depend on the whole prefix, not only on its own tokens.
HashFn = Callable[[BlockHash | None, tuple[int, ...]], BlockHash]


def hash_block_tokens(parent: BlockHash | None, tokens: tuple[int, ...]) -> bytes:
    """128-bit blake2b over the parent digest and the block's token ids."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if isinstance(parent, bytes) else repr(parent).encode())
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None     # None unless registered in the hash map
    parent_hash: BlockHash | None = None    # hash of the previous block of the chain
    token_ids: tuple[int, ...] | None = None  # the tokens it holds, when hashed

    def drop_hash(self) -> None:
        self.block_hash = self.parent_hash = self.token_ids = None


class BlockPool:
    """Blocks, the LRU free queue and the hash -> block map. No request knowledge."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 1, num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block_id -> None, in LRU order (head = next to allocate). O(1) removal.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[BlockHash, Block] = {}
        self.num_free_cached = 0   # ref-0 hashed blocks (kept as a count: stats read it each step)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def num_allocatable(self) -> int:
        return len(self.free_queue)

    def lookup(self, h: BlockHash, parent: BlockHash | None, tokens: tuple[int, ...]) -> Block | None:
        """The cached block for this chain link, verified against its stored tokens."""
        block = self.hash_to_block.get(h)
        if block is None or block.token_ids != tokens or block.parent_hash != parent:
            return None
        return block

    def touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_queue[block_id]
            self.num_free_cached -= block.block_hash is not None
        block.ref_cnt += 1

    def pop_free(self, n: int) -> list[int]:
        """Take n blocks from the free-queue head, evicting their hashes. Caller checked n."""
        assert n <= len(self.free_queue), (n, len(self.free_queue))
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0, f"block {block_id} in free queue with ref_cnt {block.ref_cnt}"
            if block.block_hash is not None:
                del self.hash_to_block[block.block_hash]
                block.drop_hash()
                self.num_free_cached -= 1
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def release(self, block_ids: list[int]) -> None:
        """ref-- in the given order; blocks reaching 0 are appended to the tail."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"block {block_id} released with ref_cnt {block.ref_cnt}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None
                self.num_free_cached += block.block_hash is not None

    def register(self, block_id: int, h: BlockHash, parent: BlockHash | None,
                 tokens: tuple[int, ...]) -> bool:
        """Cache a full block. An identical block already cached keeps the mapping."""
        if h in self.hash_to_block:
            return False
        block = self.blocks[block_id]
        assert block.block_hash is None and block.ref_cnt > 0, f"block {block_id}: hashed or free"
        block.block_hash, block.parent_hash, block.token_ids = h, parent, tokens
        self.hash_to_block[h] = block
        return True

    def reset_hashes(self) -> None:
        assert len(self.free_queue) == len(self.blocks), "reset with blocks held"
        for block in self.hash_to_block.values():
            block.drop_hash()
        self.hash_to_block.clear()
        self.num_free_cached = 0


@dataclass(slots=True)
class _ReqBlocks:
    block_ids: list[int] = field(default_factory=list)
    num_hashed: int = 0                 # leading blocks already hash-registered (or skipped)
    last_hash: BlockHash | None = None  # chain hash of block num_hashed - 1


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
        parent: BlockHash | None = None
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
            rb = self._reqs[rid] = _ReqBlocks()
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
