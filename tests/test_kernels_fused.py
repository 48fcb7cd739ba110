"""The CUDA path's fused elementwise Triton kernels (kernels/fused_ops.py) against
the eager model's references (kernels/cpu_fused_ops.py `*_ref`): rows, widths
that are not powers of two, strided rows, three dtypes, the in-place contracts.
Without CUDA they run in the Triton interpreter (conftest sets it)."""
import pytest
import torch

from formwork.kernels import cpu_fused_ops as ref
from formwork.kernels import fused_ops as fo
from fused_contract import check_rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = [0, 1, 5, 33]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


TRUNCATING = DEVICE == "cpu"   # the interpreter's casts to bf16 (see close)


def close(got, want, ulps: int = 1, loose: bool = False):
    """Half types: the kernels round where the references round, so on CUDA all but
    rare elements are bit-equal and those are `ulps` ulps apart (the mean's
    summation order, exp's last bit, more where a rounded intermediate is
    multiplied again). Triton's interpreter casts to bf16 by truncation, not
    round-to-nearest (checked: half of plain fp32 -> bf16 casts differ from
    torch's), so under it bf16 is only checked to 4 ulps of the tensor's largest
    value (a cancellation in the rotary's sum makes element-relative bounds
    meaningless there), which still fails any wrong formula. `loose` applies that
    bound to both half types on any device: the rotary on CUDA (H200, triton 3.6)
    was off by up to 2 ulps in 18 of its 24 half-type cases (its products are
    likely contracted into FMAs, skipping the reference's intermediate rounding).
    fp32: summation order."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.numel() == 0:
        return
    if want.dtype == torch.bfloat16 and TRUNCATING or loose and want.dtype != torch.float32:
        step = 2 ** -7 if want.dtype == torch.bfloat16 else 2 ** -10
        diff = (got.float() - want.float()).abs()
        assert diff.max() <= 4 * step * want.float().abs().max(), diff.max()
    elif want.dtype in (torch.bfloat16, torch.float16):
        step = 2 ** -7 if want.dtype == torch.bfloat16 else 2 ** -10
        diff = (got.float() - want.float()).abs()
        assert bool((diff <= want.float().abs().clamp_min(1e-4) * step * ulps * 1.01).all()), diff.max()
        assert (got != want).float().mean().item() < 0.02
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def rand(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [576, 100])
def test_rms_norm_and_add(dtype, rows, width):
    g = torch.Generator().manual_seed(rows * 7 + width)
    x = rand(g, rows, width, dtype=dtype, scale=3)
    w = (torch.rand(width, generator=g) + 0.5).to(dtype).to(DEVICE)
    close(fo.rms_norm(x, w, 1e-5), ref.rms_norm_ref(x, w, 1e-5))
    res = rand(g, rows, width, dtype=dtype)
    r1, r2, x_before = res.clone(), res.clone(), x.clone()
    out1, back1 = fo.add_rms_norm(x, r1, w, 1e-6)
    out2, back2 = ref.add_rms_norm_ref(x, r2, w, 1e-6)
    assert back1 is r1 and back2 is r2                   # the residual is updated in place
    if dtype == torch.bfloat16 and TRUNCATING:
        close(r1, r2)
    else:
        assert torch.equal(r1, r2) and torch.equal(r1, res + x)
    assert torch.equal(x, x_before)
    close(out1, out2)


def test_rms_norm_strided_rows():
    g = torch.Generator().manual_seed(1)
    big = rand(g, 6, 200, dtype=torch.bfloat16)
    x, w = big[:, :150], (torch.rand(150, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE)
    close(fo.rms_norm(x, w, 1e-5), ref.rms_norm_ref(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (2, 1, 128), (3, 1, 48)])
def test_rotary(dtype, rows, heads, kv_heads, head_dim):
    check_rotary(fo.rotary, close, dtype, rows, heads, kv_heads, head_dim, device=DEVICE, positions=512,
                 loose=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", [1536, 100, 2500])    # 2500: more than one block per row
def test_silu_mul(dtype, rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    big = rand(g, rows, 2 * inter + 8, dtype=dtype, scale=4)
    gate_up = big[:, :2 * inter]
    before = gate_up.clone()
    close(fo.silu_mul(gate_up), ref.silu_mul_ref(gate_up), ulps=2)
    assert torch.equal(gate_up, before)


def test_model_with_fused_ops_matches_torch_ops(tiny_model_dir):
    """The whole tiny Llama, fp32: the model built with the Triton ops gives the
    torch ops' logits (CUDA_FUSED_OPS is what rank_setup picks on CUDA)."""
    from formwork.gpu.attention import allocate_kv_cache
    from formwork.gpu.attention_torch import TorchAttentionBackend
    from formwork.gpu.loader import load_model
    from formwork.gpu.model import CUDA_FUSED_OPS

    logits = []
    for ops in (None, CUDA_FUSED_OPS):
        backend = TorchAttentionBackend(paged_decode=False)
        model = load_model(tiny_model_dir, dtype=torch.float32, device=torch.device(DEVICE),
                           attn_backend=backend, ops=ops)
        cfg = model.config
        kv = allocate_kv_cache(cfg.num_hidden_layers, 8, 16, cfg.num_key_value_heads, cfg.head_dim,
                               torch.float32, torch.device(DEVICE))
        ids = torch.arange(100, 113, device=DEVICE)
        meta = backend.build_metadata([13], [13], [[0]], 16, DEVICE)
        hidden = model(ids, torch.arange(13, device=DEVICE), kv, meta)
        logits.append(model.compute_logits(hidden))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
