"""The block pool under the KV-cache manager: blocks, their ref counts, the LRU
free queue and the prefix-cache hash map. No request knowledge (that is
core/kv_cache.py's KVCacheManager, the only user).

Every block is exactly one of
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
from dataclasses import dataclass

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
