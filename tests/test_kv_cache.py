"""KVCacheManager / BlockPool: exact block ids, ref counts, free-queue order,
prefix hits, collision verification, eviction, and a stateful property test."""
from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from formwork.core.kv_cache import KVCacheManager
from formwork.core.request import Request
from formwork.schemas.sampling import SamplingParams

BS = 4


def make_req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=100))


def prefill(kv: KVCacheManager, req: Request) -> list[int]:
    """Admit req like the scheduler: prefix lookup, allocate, commit, cache."""
    hit_ids, hit = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - hit, hit_ids)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req, req.num_computed_tokens)
    return new


def refs(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def free_queue(kv: KVCacheManager) -> list[int]:
    return list(kv.pool.free_queue)


def snapshot(kv: KVCacheManager) -> tuple:
    blocks = [(b.ref_cnt, b.block_hash, b.parent_hash, b.token_ids) for b in kv.pool.blocks]
    reqs = {r: (list(rb.block_ids), rb.num_hashed, rb.last_hash) for r, rb in kv._reqs.items()}
    return blocks, free_queue(kv), dict(kv.pool.hash_to_block), reqs


def test_allocate_exact_ids_and_refs():
    kv = KVCacheManager(10, BS, True)
    a = make_req("a", range(10))
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    assert refs(kv) == [1, 1, 1] + [0] * 7
    assert free_queue(kv) == [3, 4, 5, 6, 7, 8, 9]
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2) == []          # 12 tokens still fit in 3 blocks
    assert kv.allocate_slots(a, 3) == [3]         # 13 tokens need a 4th
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    assert kv.usage == pytest.approx(0.4)
    kv.check_invariants()


def test_prefix_hit_shares_blocks_and_free_order():
    kv = KVCacheManager(10, BS, True)
    a = make_req("a", range(10))
    assert prefill(kv, a) == [0, 1, 2]
    assert kv.num_cached_blocks == 0               # hashed but held
    b = make_req("b", list(range(8)) + [50, 51, 52])
    assert kv.get_computed_blocks(b) == ([0, 1], 8)
    assert kv.allocate_slots(b, 3, [0, 1]) == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert refs(kv)[:4] == [2, 2, 1, 1]
    kv.check_invariants()
    kv.free(a)   # a = [0, 1, 2], reversed: only 2 reaches ref 0
    assert free_queue(kv) == [4, 5, 6, 7, 8, 9, 2]
    b.num_computed_tokens = 11
    kv.cache_full_blocks(b, 11)
    kv.free(b)   # b = [0, 1, 3] reversed -> 3, 1, 0 appended
    assert free_queue(kv) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert (kv.num_free_blocks, kv.num_cached_blocks) == (8, 2)
    assert kv.prefix_cache_queries == 21 and kv.prefix_cache_hits == 8
    kv.check_invariants()


def test_whole_prompt_never_computed():
    kv = KVCacheManager(10, BS, True)
    prefill(kv, make_req("a", range(8)))
    assert kv.get_computed_blocks(make_req("b", range(8))) == ([0], 4)   # last token recomputed
    assert kv.get_computed_blocks(make_req("c", range(9))) == ([0, 1], 8)
    assert kv.get_computed_blocks(make_req("d", range(3))) == ([], 0)


def test_cached_ref0_block_revived_and_counted():
    kv = KVCacheManager(4, BS, True)
    a = make_req("a", range(8))
    prefill(kv, a)                              # blocks 0, 1; block 1 not hashed? 8 tokens -> both full
    kv.free(a)
    assert free_queue(kv) == [2, 3, 1, 0] and kv.num_cached_blocks == 2
    b = make_req("b", list(range(8)) + [9])
    ids, hit = kv.get_computed_blocks(b)
    assert (ids, hit) == ([0, 1], 8)
    assert kv.num_blocks_to_allocate(b, 1, ids) == 3  # 2 revived + 1 fresh
    assert kv.allocate_slots(b, 1, ids) == [2]
    assert free_queue(kv) == [3] and refs(kv) == [1, 1, 1, 0]
    kv.check_invariants()


def test_eviction_pops_lru_head_and_drops_hash():
    kv = KVCacheManager(4, BS, True)
    a = make_req("a", range(9))
    prefill(kv, a)                              # blocks 0, 1 (hashed), 2
    kv.free(a)
    assert free_queue(kv) == [3, 2, 1, 0]
    c = make_req("c", [70] * 12)
    assert kv.allocate_slots(c, 12) == [3, 2, 1]  # evicts block 1 (a's 2nd block)
    assert kv.pool.blocks[1].block_hash is None and kv.num_cached_blocks == 1
    assert kv.get_computed_blocks(make_req("d", range(9))) == ([0], 4)
    kv.check_invariants()


def test_allocate_failure_changes_nothing():
    kv = KVCacheManager(3, BS, True)
    a = make_req("a", range(8))
    prefill(kv, a)
    before = snapshot(kv)
    b = make_req("b", range(100, 109))
    assert not kv.can_allocate(b, 9)
    assert kv.allocate_slots(b, 9) is None
    assert snapshot(kv) == before
    assert not kv.holds("b")


def test_collision_verified_by_tokens():
    kv = KVCacheManager(8, BS, True, hash_fn=lambda parent, toks: sum(toks))  # weak on purpose
    prefill(kv, make_req("a", [1, 2, 3, 4, 9]))
    # same hash (sum 10), other tokens: a miss, not a wrong hit
    assert kv.get_computed_blocks(make_req("b", [4, 3, 2, 1, 9])) == ([], 0)
    assert kv.get_computed_blocks(make_req("c", [1, 2, 3, 4, 7])) == ([0], 4)
    # b's block collides with a's: the existing mapping is kept, b's stays unhashed
    b = make_req("b2", [4, 3, 2, 1, 9])
    prefill(kv, b)
    assert kv.pool.hash_to_block[10].block_id == 0 and kv.pool.blocks[2].block_hash is None
    kv.check_invariants()


def test_collision_verified_by_parent():
    kv = KVCacheManager(8, BS, True, hash_fn=lambda parent, toks: toks)  # ignores the chain
    prefill(kv, make_req("x", [5, 5, 5, 5, 0]))          # block 0: tokens B, parent None
    prefill(kv, make_req("a", [1, 1, 1, 1, 5, 5, 5, 5, 0]))  # its block B: duplicate, unhashed
    # block 1 of "a2" has tokens B but follows A: x's block (parent None) must not match
    ids, hit = kv.get_computed_blocks(make_req("a2", [1, 1, 1, 1, 5, 5, 5, 5, 0]))
    assert (ids, hit) == (kv.get_block_ids("a")[:1], 4)


def test_prefix_caching_disabled():
    kv = KVCacheManager(8, BS, False)
    prefill(kv, make_req("a", range(9)))
    assert kv.get_computed_blocks(make_req("b", range(9))) == ([], 0)
    assert not kv.pool.hash_to_block
    kv.check_invariants()


def test_double_free_and_reset():
    kv = KVCacheManager(8, BS, True)
    a = make_req("a", range(9))
    prefill(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    with pytest.raises(AssertionError, match="double free"):
        kv.free(a)
    assert kv.num_cached_blocks == 2
    assert kv.reset_prefix_cache() is True
    assert (kv.num_free_blocks, kv.num_cached_blocks) == (8, 0)
    kv.check_invariants()


@pytest.mark.parametrize("corrupt, message", [
    (lambda kv: setattr(kv.pool.blocks[0], "ref_cnt", 2), "ref_cnt 2, held by 1"),
    (lambda kv: kv.pool.free_queue.__setitem__(1, None), "in free queue True"),
    (lambda kv: kv.pool.free_queue.pop(7), "in free queue False"),
    (lambda kv: kv.pool.blocks[0].drop_hash(), "stale hash"),
    (lambda kv: kv.pool.hash_to_block.pop(kv.pool.blocks[0].block_hash), "not mapped"),
    (lambda kv: kv._reqs["a"].block_ids.append(0), "duplicate blocks"),
    (lambda kv: setattr(kv.pool, "num_free_cached", 1), "num_free_cached 1, counted 0"),
])
def test_check_invariants_detects_corruption(corrupt, message):
    kv = KVCacheManager(8, BS, True)
    prefill(kv, make_req("a", range(9)))
    kv.check_invariants()
    corrupt(kv)
    with pytest.raises(AssertionError, match=message):
        kv.check_invariants()


class KVMachine(RuleBasedStateMachine):
    """Admit / decode / free random requests over shared prefixes. A fake K/V store
    records which token each slot holds: every prefix hit must return blocks whose
    slots hold exactly the request's tokens."""

    @initialize(num_blocks=st.integers(3, 12), caching=st.booleans())
    def setup(self, num_blocks, caching):
        self.kv = KVCacheManager(num_blocks, BS, caching)
        self.slots: dict[int, list[int | None]] = {b: [None] * BS for b in range(num_blocks)}
        self.reqs: dict[str, Request] = {}
        self.n = 0

    def _write(self, req: Request, start: int, end: int) -> None:
        ids = self.kv.get_block_ids(req.request_id)
        for p in range(start, end):
            self.slots[ids[p // BS]][p % BS] = req.all_token_ids[p]

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=9))
    def admit(self, prefix, tail):
        req = make_req(f"r{self.n}", prefix + tail)
        self.n += 1
        ids, hit = self.kv.get_computed_blocks(req)
        assert hit < req.num_tokens and hit == len(ids) * BS
        for i, b in enumerate(ids):
            assert self.slots[b] == req.all_token_ids[i * BS:(i + 1) * BS], "hit on stale block"
        before = snapshot(self.kv)
        if self.kv.allocate_slots(req, req.num_tokens - hit, ids) is None:
            assert snapshot(self.kv) == before
            return
        self._write(req, hit, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
        self.kv.cache_full_blocks(req, req.num_tokens)
        self.reqs[req.request_id] = req

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        req = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        req.output_token_ids.append(token)
        if self.kv.allocate_slots(req, 1) is None:
            req.output_token_ids.pop()
            return
        self._write(req, req.num_computed_tokens, req.num_tokens)
        req.num_computed_tokens += 1
        self.kv.cache_full_blocks(req, req.num_computed_tokens)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        req = self.reqs.pop(data.draw(st.sampled_from(sorted(self.reqs))))
        self.kv.free(req)

    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check_invariants()
        held = sum(b.ref_cnt > 0 for b in self.kv.pool.blocks)
        assert self.kv.num_free_blocks + self.kv.num_cached_blocks + held == self.kv.num_blocks
        for req in self.reqs.values():
            assert len(self.kv.get_block_ids(req.request_id)) == -(-req.num_tokens // BS)


KVMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestKVMachine = KVMachine.TestCase


def test_cache_salt_partitions_prefix_hits():
    """vLLM's cache_salt: blocks are shared only among requests with the same salt;
    unsalted requests share among themselves as before."""
    kv = KVCacheManager(32, BS, True)

    def salted(rid, salt):
        return Request(rid, list(range(13)), SamplingParams(max_tokens=4, cache_salt=salt))

    first = {}
    for rid, salt in [("a", None), ("b", "tenant-1"), ("c", "tenant-2")]:
        req = salted(rid, salt)
        assert kv.get_computed_blocks(req) == ([], 0)        # nothing shared across salts
        first[salt] = prefill(kv, req)
    for rid, salt in [("a2", None), ("b2", "tenant-1"), ("c2", "tenant-2")]:
        hit_ids, hit = kv.get_computed_blocks(salted(rid, salt))
        assert hit == 12 and hit_ids == first[salt][:3]        # the same salt's own blocks
    kv.check_invariants()
    with pytest.raises(ValueError, match="^cache_salt"):
        SamplingParams(cache_salt="")
