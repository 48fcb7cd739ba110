"""The CPU fast path's kernels against their references: the fused elementwise
ops (kernels/cpu_fused_ops.py) over row counts, widths (vector tails included),
strided rows and both dtypes, with their in-place contracts; the packed oneDNN
linear (gpu/cpu_linear.py) against F.linear."""
import platform
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from formwork.gpu.cpu_linear import PackedLinear, pack_linears, packing_supported
from formwork.kernels import cpu_fused_ops as fo
from fused_contract import check_rotary

HAVE_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None
pytestmark = pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler on this machine")
ROWS = [0, 1, 5, 48, 333]
DTYPES = [torch.float32, torch.bfloat16]


def close(got, want, ulps: int = 1):
    """bf16: the references round at the same points, so all but a rare element are
    bit-equal and those differ by `ulps` bf16 ulps (one rounding apart; two where a
    rounded intermediate is multiplied again); fp32: summation order only."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.numel() == 0:
        return
    if want.dtype == torch.bfloat16:
        diff = (got.float() - want.float()).abs()
        ulp = want.float().abs().clamp_min(1e-30) * 2 ** -7
        assert bool((diff <= ulp * ulps * 1.01).all()), diff.max()
        assert (got != want).float().mean().item() < 0.01
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_extension_builds():
    assert fo.available(), fo.failure()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [576, 100])           # 100: not a multiple of the vector width
def test_rms_norm_and_add(dtype, rows, width):
    g = torch.Generator().manual_seed(rows * 7 + width)
    x = (torch.randn(rows, width, generator=g) * 3).to(dtype)
    w = (torch.rand(width, generator=g) + 0.5).to(dtype)
    close(fo.rms_norm(x, w, 1e-5), fo.rms_norm_ref(x, w, 1e-5))
    res = torch.randn(rows, width, generator=g).to(dtype)
    r1, r2, x_before = res.clone(), res.clone(), x.clone()
    out1, back1 = fo.add_rms_norm(x, r1, w, 1e-6)
    out2, back2 = fo.add_rms_norm_ref(x, r2, w, 1e-6)
    assert back1 is r1 and back2 is r2                   # the residual is updated in place
    assert torch.equal(r1, r2) and torch.equal(r1, (res + x))
    assert torch.equal(x, x_before)
    close(out1, out2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (2, 1, 128)])
def test_rotary(dtype, rows, heads, kv_heads, head_dim):
    check_rotary(fo.rotary, close, dtype, rows, heads, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", [1536, 37])
def test_silu_mul(dtype, rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    gu = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    close(fo.silu_mul(gu), fo.silu_mul_ref(gu), ulps=2)


def test_refuses_bad_layouts():
    x = torch.randn(4, 64)
    with pytest.raises(AssertionError):
        fo.rms_norm(x.t(), torch.ones(4), 1e-5)           # column-strided rows
    with pytest.raises(AssertionError):
        fo.rms_norm(x.half(), torch.ones(64).half(), 1e-5)
    with pytest.raises(AssertionError):
        fo.rotary(torch.randn(2, 64), torch.zeros(2, dtype=torch.int32), torch.ones(8, 32),
                  torch.ones(8, 32), 1, 0)


def _cpu_lets_onednn_pack_bf16() -> bool:
    """oneDNN's own condition for bf16 weight packing (its error says so on other
    CPUs): AVX-512 BW, VL and DQ, or AVX-NE-CONVERT."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    flags = set(re.findall(r"\w+", line))
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


CAN_PACK = packing_supported(torch.bfloat16, torch.device("cpu"))
needs_packing = pytest.mark.skipif(not CAN_PACK, reason="oneDNN packs no bf16 weights on this "
                                   "CPU (test_packing_is_found_where_the_cpu_has_it checks why)")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="oneDNN's bf16 packing condition is known here for x86 only")
def test_packing_is_found_where_the_cpu_has_it():
    """Packing is used exactly where the CPU allows it: a torch change that broke
    the probe would otherwise turn the fast path off silently (and on an AVX2-only
    CPU the executor must keep F.linear, not fail)."""
    assert CAN_PACK == _cpu_lets_onednn_pack_bf16()


@needs_packing
@pytest.mark.parametrize("rows", [1, 7, 48, 64, 300, 2048])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(576, 960, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(960, 576, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(960, generator=g))
    x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    packed = PackedLinear(lin)
    got, want = packed(x), F.linear(x, lin.weight, lin.bias)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert packed(x.view(1, rows, 576)).shape == (1, rows, 960)      # leading dims kept


def test_packing_is_cpu_bf16_only():
    assert not packing_supported(torch.float32, torch.device("cpu"))
    assert not packing_supported(torch.bfloat16, torch.device("meta"))


@needs_packing
def test_pack_linears_keeps_parameters():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 8, bias=False)))
    model = model.to(torch.bfloat16)
    keys = set(model.state_dict())
    w = model[0].weight
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert set(model.state_dict()) == keys and model[0].weight is w
