"""The kernels compile for a Hopper GPU (sm_90), without one.

The interpreter runs the kernels' Python, not Triton's compiler: type rules of
loop-carried values, constexpr handling and layout conversion are only checked
by a real compile. Triton's wheel carries ptxas, so a cubin can be built here.
"""
import inspect
import os
import subprocess
import sys

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from formwork.kernels import bitmask, kv_store, paged_attention

pytestmark = pytest.mark.slow  # a few seconds per compile on a CPU

# Triton's interpreter patches triton.language builtins in the process that ran
# it, and a real compile afterwards can fail on the patched functions; so the
# compiles run in a fresh interpreter (this module, re-entered as a child).
_CHILD = os.environ.get("FORMWORK_COMPILE_CHILD") == "1"


def test_kernels_compile_in_a_fresh_process(tmp_path):
    if _CHILD:
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(FORMWORK_COMPILE_CHILD="1", TRITON_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                           "-k", "not fresh_process"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "3 passed" in proc.stdout, proc.stdout[-2000:]

HOPPER = GPUTarget("cuda", 90, 32)


@pytest.fixture(autouse=True)
def _compile_env(monkeypatch, tmp_path):
    """A private cache (a fresh compile, no race with other processes' caches);
    no interpreter, so that triton.jit builds a compilable JITFunction."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _compile(lazy_kernel, types: dict[str, str], constexprs: dict, **options):
    """types: a Triton type per non-constexpr parameter, by name ('*bf16', 'i32', ...)."""
    params = list(inspect.signature(lazy_kernel.fn).parameters)
    assert set(params) == set(types) | set(constexprs), "signature drifted from this test"
    signature = {p: types.get(p, "constexpr") for p in params}
    fn = triton.jit(lazy_kernel.fn)
    compiled = triton.compile(ASTSource(fn, signature, constexprs), target=HOPPER, options=options)
    assert compiled.asm["cubin"], "no machine code"
    return compiled


def test_bitmask_and_kv_store_compile():
    _compile(bitmask._bitmask_kernel,
             {"logits_ptr": "*bf16", "bitmask_ptr": "*i32", "indices_ptr": "*i64", "vocab": "i32",
              "num_words": "i32", "logits_stride": "i32", "bitmask_stride": "i32"},
             {"HAS_INDICES": True, "BLOCK": 1024}, num_warps=4)
    ints = ("num_kv_heads", "head_dim", "k_stride_t", "k_stride_h", "v_stride_t", "v_stride_h",
            "c_stride_b", "c_stride_o", "c_stride_h")
    _compile(kv_store._store_kv_kernel,
             {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
              "slot_ptr": "*i64", **{n: "i32" for n in ints}},
             {"BLOCK_SIZE": 16, "BLOCK_H": 4, "BLOCK_D": 64}, num_warps=4)


@pytest.mark.parametrize("dtype,group,block_m,precision", [
    ("bf16", 3, 16, "tf32"),   # decode tiling, SmolLM2's GQA ratio
    ("fp16", 1, 64, "tf32"),   # tall prefill tiling
])
def test_paged_attention_compiles(dtype, group, block_m, precision):
    ints = ("num_seqs", "head_dim", "q_stride_t", "q_stride_h", "o_stride_t", "o_stride_h",
            "c_stride_b", "c_stride_o", "c_stride_h", "bt_stride")
    types = {**{n: f"*{dtype}" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")},
             **{n: "*i32" for n in ("block_table_ptr", "query_start_loc_ptr", "seq_lens_ptr")},
             "qk_scale": "fp32", **{n: "i32" for n in ints}}
    _compile(paged_attention._paged_attention_kernel, types,
             {"G": group, "BLOCK_M": block_m, "BLOCK_Q": block_m // group, "HEAD_DIM_P": 64,
              "BLOCK_SIZE": 16, "TILE_N": 32, "PRECISION": precision}, num_warps=4)


if not _CHILD:   # collected only in the child process started above
    del test_bitmask_and_kv_store_compile, test_paged_attention_compiles
