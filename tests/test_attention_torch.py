"""The torch attention backend (the CPU serving path) against the paged
attention reference, including reuse of its gather workspace across calls of
different shapes."""
import pytest
import torch

from formwork.gpu.attention import allocate_kv_cache
from formwork.gpu.attention_torch import TorchAttentionBackend
from formwork.kernels.paged_attention import paged_attention_ref


def _case(gen, backend, query_lens, seq_lens, bs=8, heads=6, kv_heads=2, dim=16, num_blocks=64):
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for s in seq_lens:
        n = -(-s // bs)
        tables.append(perm[used:used + n])
        used += n
    meta = backend.build_metadata(query_lens, seq_lens, tables, bs, "cpu")
    t = sum(query_lens)
    q, k, v = (torch.randn(t, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    (kc, vc), = allocate_kv_cache(1, num_blocks, bs, kv_heads, dim, torch.float32, "cpu")
    kc.copy_(torch.randn(kc.shape, generator=gen))
    vc.copy_(torch.randn(vc.shape, generator=gen))
    return meta, q, k, v, kc, vc


@pytest.mark.parametrize("paged_decode", [False, True], ids=["gather-sdpa", "cpu-kernel"])
def test_mixed_batches_match_reference_and_workspace_reuse_is_safe(paged_decode):
    gen = torch.Generator().manual_seed(7)
    backend = TorchAttentionBackend(paged_decode=paged_decode)
    cases = [  # decodes of very different lengths (several groups), fresh and cached prefills
        ([1, 1, 1, 1, 1, 7, 12], [3, 90, 95, 9, 160, 7, 40]),
        ([1, 1], [200, 17]),               # bigger gather than the first case's groups
        ([5, 1, 1, 1], [5, 2, 8, 16]),     # smaller: the workspace is reused, not regrown
        ([3, 1, 2, 9], [50, 30, 17, 60]),  # short chunks over cached blocks (jump-forward)
    ]
    kept = []
    for query_lens, seq_lens in cases:
        meta, q, k, v, kc, vc = _case(gen, backend, query_lens, seq_lens)
        decode_groups = [g for g in meta.groups if g.token_index is not None]
        assert (meta.decode is not None) == paged_decode and bool(decode_groups) != paged_decode
        if paged_decode:   # all-decode batches skip the row index
            assert (meta.decode.token_index is None) == all(n == 1 for n in query_lens)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        out = backend.forward(q, k, v, kc, vc, meta, 0.3)
        # the reference reads the cache after the same store
        kc_ref.view(-1, k.shape[1], k.shape[2])[meta.slot_mapping] = k
        vc_ref.view(-1, v.shape[1], v.shape[2])[meta.slot_mapping] = v
        want = paged_attention_ref(q, kc_ref, vc_ref, meta.block_table, meta.query_start_loc,
                                   meta.seq_lens, 0.3)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
        kept.append((out, out.clone()))
    for out, snapshot in kept:   # outputs are not views of the reused workspace
        assert torch.equal(out, snapshot)
    decode_groups = [g for g in TorchAttentionBackend(paged_decode=False).build_metadata(
        *cases[0], [list(range(i * 20, i * 20 + 20)) for i in range(7)], 8, "cpu").groups
        if g.token_index is not None]
    assert len(decode_groups) >= 2   # the first case really split decodes into padded groups


def _shmem_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next((int(line.split()[1]) for line in f if line.startswith("Pss_Shmem")), 0)


def _rss_bytes() -> int:
    import os
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps_rollup"), reason="needs /proc")
def test_cpu_kv_cache_commits_memory_only_where_written():
    """A CPU KV cache of 8 x 2 x 16 MB is zero and writable, yet holds (almost) no
    memory until written: an idle engine does not pay for its whole cache."""
    before, shmem = _rss_bytes(), _shmem_kb()
    caches = allocate_kv_cache(8, 2048, 16, 4, 64, torch.bfloat16, "cpu")   # 16 MB each
    assert _rss_bytes() - before < 32 << 20          # nothing written: nothing held
    assert caches[0][0].shape == (2048, 16, 4, 64) and caches[0][0].dtype == torch.bfloat16
    assert all(float(t.amax()) == 0 == float(t.amin()) for kv in caches for t in kv)
    for k, v in caches:
        k[3, 5] = 1.5
        v.fill_(2.0)
    assert float(caches[7][0][3, 5].sum()) == 1.5 * 4 * 64
    assert _rss_bytes() - before > 100 << 20         # every V page written: committed
    # ... as private anonymous memory (as malloc's), not shmem: a fork copies on write
    assert _shmem_kb() - shmem < 16 << 10
