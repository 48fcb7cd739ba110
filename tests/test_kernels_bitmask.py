"""Bitmask apply: Triton kernel and torch implementation against the loop reference.

Without CUDA the Triton kernel runs in the interpreter: TRITON_INTERPRET is set
here, before any test runs; kernels are jitted at their first launch
(kernels._jit), so the order in which test modules import them does not matter.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from formwork.kernels.bitmask import (  # noqa: E402
    apply_bitmask,
    apply_bitmask_ref,
    apply_bitmask_torch,
    apply_bitmask_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCABS = [49152, 32000 + 7]


def _random_bitmask(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Random words, plus an all-zero row, an all-one row and a sparse row."""
    words = (vocab + 31) // 32
    bm = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    if rows >= 3:
        bm[0] = 0
        bm[1] = -1
        bm[2] = 0
        allowed = torch.randint(0, vocab, (5,), generator=gen)
        for t in allowed.tolist():
            bm[2, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    return bm


def _random_logits(rows: int, vocab: int, dtype: torch.dtype, gen: torch.Generator):
    return (torch.randn(rows, vocab, generator=gen) * 5).to(dtype)


def test_ref_matches_hand_example():
    logits = torch.zeros(2, 40)
    bitmask = torch.tensor([[0b1011, 0b1], [-1, 0]], dtype=torch.int32)
    apply_bitmask_ref(logits, bitmask)
    allowed = [sorted(torch.nonzero(torch.isfinite(r)).flatten().tolist()) for r in logits]
    assert allowed == [[0, 1, 3, 32], list(range(32))]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_indices", [False, True])
def test_torch_matches_ref(vocab, dtype, with_indices):
    gen = torch.Generator().manual_seed(vocab + with_indices)
    rows = 7
    bitmask = _random_bitmask(4 if with_indices else rows, vocab, gen)
    indices = [5, 0, 3, 6] if with_indices else None
    logits = _random_logits(rows, vocab, dtype, gen)
    logits[0, :3] = float("inf")  # +-inf logits keep masked_fill semantics
    logits[1, :3] = float("-inf")
    expected, actual = logits.clone(), logits.clone()
    apply_bitmask_ref(expected, bitmask, indices)
    apply_bitmask_torch(actual, bitmask, None if indices is None else torch.tensor(indices))
    assert torch.equal(actual, expected)
    untouched = [r for r in range(rows) if indices is not None and r not in indices]
    assert torch.equal(actual[untouched], logits[untouched])


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("with_indices", [False, True])
def test_triton_matches_ref(vocab, with_indices):
    gen = torch.Generator().manual_seed(vocab * 3 + with_indices)
    rows = 64 if DEVICE == "cuda" else 3  # the interpreter is ~5000x slower
    bitmask = _random_bitmask(rows, vocab, gen)
    indices = torch.randperm(rows * 2, generator=gen)[:rows] if with_indices else None
    logits = _random_logits(rows * 2 if with_indices else rows, vocab, torch.float32, gen)
    expected = logits.clone()
    apply_bitmask_ref(expected, bitmask, indices)
    actual = logits.to(DEVICE)
    apply_bitmask_triton(actual, bitmask.to(DEVICE), indices)
    assert torch.equal(actual.cpu(), expected)


def test_triton_bf16_and_row_stride():
    """bf16 logits inside a wider buffer (row stride > vocab); one row masked."""
    gen = torch.Generator().manual_seed(1)
    vocab = 32000 + 7
    buffer = _random_logits(2, vocab + 64, torch.bfloat16, gen)
    bitmask = _random_bitmask(1, vocab, gen)
    expected = buffer.clone()
    apply_bitmask_ref(expected[:, :vocab], bitmask, [1])
    actual = buffer.to(DEVICE)
    apply_bitmask_triton(actual[:, :vocab], bitmask.to(DEVICE), [1])
    assert torch.equal(actual.cpu(), expected)


def test_repeated_index_gets_both_masks():
    gen = torch.Generator().manual_seed(3)
    vocab = 1000
    logits = _random_logits(3, vocab, torch.float32, gen)
    bitmask = _random_bitmask(2, vocab, gen)
    indices = [2, 2]
    expected = logits.clone()
    expected[2, (_allowed(bitmask[0], vocab) & _allowed(bitmask[1], vocab)).logical_not()] = float("-inf")
    for apply in (apply_bitmask_ref, apply_bitmask_torch):
        actual = logits.clone()
        apply(actual, bitmask, indices)
        assert torch.equal(actual, expected), apply.__name__
    actual = logits.to(DEVICE)
    apply_bitmask_triton(actual, bitmask.to(DEVICE), indices)
    assert torch.equal(actual.cpu(), expected)


def _allowed(row: torch.Tensor, vocab: int) -> torch.Tensor:
    """[vocab] bool from one packed row, via numpy's bit unpacking (independent of the code)."""
    import numpy as np
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab]
    return torch.from_numpy(bits.astype(bool))


def test_dispatch_uses_torch_on_cpu_and_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(2)
    logits = _random_logits(2, 100, torch.float32, gen)
    bitmask = _random_bitmask(2, 100, gen)
    expected = logits.clone()
    apply_bitmask_ref(expected, bitmask)
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)
    with pytest.raises(AssertionError):
        apply_bitmask(logits, bitmask[:, :3])  # covers 96 < 100 tokens
    with pytest.raises(AssertionError):
        apply_bitmask(logits, bitmask, [0])  # 2 bitmask rows for 1 index
