"""The CPU paged decode-attention kernel (C++ extension) against its reference:
ragged contexts across block boundaries, GQA ratios 1/3/4, head_dim 64/128,
block sizes 16/32, fp32/bf16/fp16, shuffled block tables; head_dim 64 and 128
have compile-time specializations, others the generic path. bf16 with head_dim
64/128 takes the AVX-512 path where the CPU has it (16-key tiles, query heads in
chunks of <= 4 / <= 2): `test_bf16_fast_path_shapes` covers its chunking and
tile edges."""
import shutil

import pytest
import torch

from formwork.kernels import cpu_decode_attention as cda

# Every machine this project targets has a C++ compiler (the CI image included):
# there, a failed build is a failure, not a skip.
HAVE_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None
pytestmark = pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler on this machine")


def test_extension_builds():
    assert cda.available(), cda.failure()

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32), (48, 16)])  # 48: generic path
def test_matches_reference(dtype, heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim + block_size)
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size, 97]
    p, max_blocks = len(seq_lens), -(-max(seq_lens) // block_size) + 1
    num_blocks = p * max_blocks + 3
    kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[:p * max_blocks].view(p, max_blocks)
    table = table.to(torch.int32)
    q = torch.randn(p, heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    before = (kc.clone(), vc.clone(), q.clone())
    got = cda.paged_decode_attention(q, kc, vc, table, lens, 0.1)
    want = cda.paged_decode_attention_ref(q, kc, vc, table, lens, 0.1)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert all(torch.equal(a, b) for a, b in zip(before, (kc, vc, q)))   # inputs untouched


@pytest.mark.parametrize("heads,kv_heads", [(5, 1), (12, 2), (9, 3), (3, 3)])   # G = 5, 6, 3, 1
@pytest.mark.parametrize("head_dim", [64, 128, 96])                           # 96: generic path
@pytest.mark.parametrize("block_size", [8, 24])                               # partial 16-key tiles
def test_bf16_fast_path_shapes(heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(heads * 7 + head_dim + block_size)
    seq_lens = [1, 7, 16, 17, block_size * 3 + 5, 130]
    p, max_blocks = len(seq_lens), -(-max(seq_lens) // block_size)
    num_blocks = p * max_blocks + 2
    kc = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen) * 2).bfloat16()
    vc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    table = torch.randperm(num_blocks, generator=gen)[:p * max_blocks].view(p, max_blocks)
    q = torch.randn(p, heads, head_dim, generator=gen).bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    got = cda.paged_decode_attention(q, kc, vc, table.to(torch.int32), lens, head_dim ** -0.5)
    want = cda.paged_decode_attention_ref(q, kc, vc, table.to(torch.int32), lens, head_dim ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_out_argument_and_strided_query():
    gen = torch.Generator().manual_seed(1)
    kc = torch.randn(10, 16, 2, 64, generator=gen)
    vc = torch.randn(10, 16, 2, 64, generator=gen)
    qkv = torch.randn(3, 8 * 64, generator=gen)            # q as a view with a row stride
    q = qkv[:, :6 * 64].view(3, 6, 64)
    table = torch.tensor([[3, 1], [0, 2], [9, 8]], dtype=torch.int32)
    lens = torch.tensor([20, 5, 32], dtype=torch.int32)
    out = torch.full((3, 6, 64), float("nan"))
    res = cda.paged_decode_attention(q, kc, vc, table, lens, 0.125, out=out)
    assert res is out
    torch.testing.assert_close(out, cda.paged_decode_attention_ref(q, kc, vc, table, lens, 0.125),
                               atol=2e-5, rtol=2e-5)


def test_launcher_rejects_bad_inputs():
    kc = torch.zeros(4, 16, 2, 64)
    q = torch.zeros(2, 6, 64)
    table = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(AssertionError):
        cda.paged_decode_attention(q, kc, kc, table.long(), lens, 1.0)      # int64 table
    with pytest.raises(AssertionError):
        cda.paged_decode_attention(torch.zeros(2, 5, 64), kc, kc, table, lens, 1.0)  # 5 % 2 heads
    with pytest.raises(AssertionError):
        cda.paged_decode_attention(q.bfloat16(), kc, kc, table, lens, 1.0)  # mixed dtypes
