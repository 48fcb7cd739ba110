"""The rotary op's contract, checked the same way for the CPU extension
(tests/test_kernels_cpu_fused.py) and the CUDA Triton kernels
(tests/test_kernels_fused.py): rotated like `rotary_ref`, IN PLACE on strided
rows (q and k returned as views of qkv), v and the columns past qkv untouched."""
import torch

from formwork.kernels.cpu_fused_ops import rotary_ref


def check_rotary(op, close, dtype, rows, heads, kv_heads, head_dim, *, device="cpu",
                 positions=4096, **close_kw):
    g = torch.Generator().manual_seed(rows + heads + head_dim)
    width = (heads + 2 * kv_heads) * head_dim
    big = torch.randn(rows, width + 16, generator=g).to(dtype).to(device)
    qkv = big[:, :width]                                 # strided rows, a view into a wider buffer
    pos = torch.randint(0, positions, (rows,), generator=g).to(device)
    cos, sin = (torch.randn(positions, head_dim, generator=g).to(dtype).to(device) for _ in range(2))
    before, spare = qkv.clone(), big[:, width:].clone()
    want_q, want_k = rotary_ref(qkv, pos, cos, sin, heads, kv_heads)
    assert torch.equal(qkv, before)                      # the reference does not mutate
    q, k = op(qkv, pos, cos, sin, heads, kv_heads)
    close(q, want_q, **close_kw)
    close(k, want_k, **close_kw)
    if rows:                                             # rotated in place: q and k are views of qkv
        assert q.data_ptr() == qkv.data_ptr()
        assert k.data_ptr() == qkv.data_ptr() + heads * head_dim * qkv.element_size()
        assert not torch.equal(qkv, before)
    v_cols = slice((heads + kv_heads) * head_dim, None)
    assert torch.equal(qkv[:, v_cols], before[:, v_cols])        # v and the spare columns untouched
    assert torch.equal(big[:, width:], spare)
