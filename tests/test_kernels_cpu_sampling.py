"""The sampler's C++ passes (kernels/cpu_sampling.py) against their torch references:
first maxima and ordered top-k over widths with vector tails, ties, -inf and NaN
rows, strided rows; and the sampler's picks through them equal torch's."""
import shutil

import pytest
import torch

from formwork.gpu import sampler as sampler_mod
from formwork.kernels import cpu_sampling as cs
from test_sampler import batch_for

HAVE_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None
pytestmark = pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler on this machine")
WIDTHS = [1, 7, 16, 17, 100, 4099]
INF = float("inf")


def rows_with_edges(width: int, seed: int) -> torch.Tensor:
    """Random rows, then rows with ties for the maximum (first / last / middle),
    all -inf, mostly -inf, NaN (first, inside, last) and +inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, width, generator=g) * 4
    x[0] = torch.randint(0, 3, (width,), generator=g).float()        # many ties
    x[1].fill_(-INF)
    x[2].fill_(-INF)
    x[2, width // 2] = 1.0
    x[3, width - 1] = x[3].max() + 1
    x[4, :] = x[4].max()                                              # all equal
    x[5, width // 3] = float("nan")
    x[6, width - 1] = float("nan")
    x[7, 0] = float("nan")
    x[7, width - 1] = float("nan")
    x[8, width // 2] = INF
    x[9] = -x[9].abs()                                                # all negative
    x[10, ::2] = -INF
    return x


def test_extension_builds():
    assert cs.available(), cs.failure()


@pytest.mark.parametrize("width", WIDTHS)
def test_row_max_equals_torch(width):
    x = rows_with_edges(width, width)
    vals, idx = cs.row_max(x)
    want_vals, want_idx = cs.row_max_ref(x)
    assert torch.equal(idx, want_idx)
    assert torch.equal(vals.isnan(), want_vals.isnan())
    assert torch.equal(vals.nan_to_num(), want_vals.nan_to_num())


def test_row_max_first_of_ties_and_strided_rows():
    x = torch.zeros(3, 64)
    x[0, [5, 9, 40]] = 2.0
    x[1, [63, 17]] = 1.0
    big = torch.randn(3, 80)
    big[:, :64] = x                       # rows of stride 80, unit column stride
    for t in (x, big[:, :64]):
        _, idx = cs.row_max(t)
        assert idx.tolist() == [5, 17, 0]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_row_topk_equals_sorted_reference(width, k):
    x = rows_with_edges(width, 100 + width)
    rows = torch.tensor([11, 0, 3, 1, 2, 5, 7, 8, 10, 0])            # repeats, any order
    vals, ids = cs.row_topk(x, rows, k)
    want_vals, want_ids = cs.row_topk_ref(x, rows, k)
    assert torch.equal(ids, want_ids)
    assert torch.equal(vals, want_vals)
    # the values are torch.topk's where the row has k values above -inf
    for i, r in enumerate(rows.tolist()):
        finite = x[r][x[r] > -INF]
        if finite.numel() >= k and not x[r].isnan().any():
            assert torch.equal(vals[i], x[r].topk(k).values)


def test_row_topk_orders_ties_by_id():
    x = torch.full((1, 40), -1.0)
    x[0, [30, 3, 17]] = 5.0
    x[0, 8] = 6.0
    vals, ids = cs.row_topk(x, torch.tensor([0]), 4)
    assert ids.tolist() == [[8, 3, 17, 30]] and vals.tolist() == [[6.0, 5.0, 5.0, 5.0]]
    vals, ids = cs.row_topk(x, torch.tensor([0]), 2)        # the tie is cut at id order
    assert ids.tolist() == [[8, 3]]


def test_sampler_greedy_pick_and_candidates_match_torch(monkeypatch):
    """The sampler through the C++ passes and through torch: the same greedy picks and
    the same rescue candidates on rows full of ties."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (6, 300), generator=g).float()
    logits[2, 7] = 9.0
    picks = {}
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(cs, "usable", lambda x: False)
        values, chosen = sampler_mod._row_max(logits.clone())
        vals, ids = sampler_mod._best(logits, torch.tensor([0, 2, 5]), 8)
        picks[fast] = (chosen.tolist(), values.tolist(), [sorted(zip(v, i)) for v, i in zip(vals, ids)])
    assert picks[True][:2] == picks[False][:2]
    # torch.topk's ties are in no defined order, and may be different ones at the edge:
    # the values agree
    assert [[v for v, _ in r] for r in picks[True][2]] == [[v for v, _ in r] for r in picks[False][2]]


@pytest.mark.parametrize("vocab,block", [(49152, 192), (1000, 25), (997, 1), (4096, 64)])
def test_draw_equals_the_inverse_cdf_reference(vocab, block):
    """Same uniforms, same tokens as a float64 cumulative sum over the whole row, but
    where a draw falls within rounding of a token edge; -inf tokens never drawn."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g) * 3
    x[1, ::3] = -INF                       # masked tokens
    x[2, :] = -INF
    x[2, [5, vocab - 1]] = 1.0             # two allowed, far apart
    x[3] *= 20                             # peaked
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 1])
    maxv = x.index_select(0, rows).amax(-1)
    inv_t = torch.tensor([1.0, 1.3, 1.0, 0.5, 2.0, 1 / 1.7, 1.0])
    u = 1.0 - torch.rand(7, 64, generator=g)
    got = cs.draw(x, rows, maxv, inv_t, u, block)
    want = cs.draw_ref(x, rows, maxv, inv_t, u, block)
    assert (got >= 0).all()
    assert ((got == want).float().mean()) > 0.99
    differ = (got != want).nonzero().tolist()
    for i, j in differ:                    # only neighbours in CDF order: a rounding edge
        lo, hi = sorted((int(got[i, j]), int(want[i, j])))
        w = x[int(rows[i]), lo + 1:hi]
        assert (w == -INF).all() or hi - lo == 1
    assert (x[1, got[1]] > -INF).all() and (x[1, got[6]] > -INF).all()
    assert set(got[2].tolist()) <= {5, vocab - 1}


def test_draw_frequencies_follow_the_tempered_softmax():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(1, 384, generator=g) * 2
    logits[0, 100:200] = -INF
    n = 40000
    x = logits.expand(n, -1).contiguous()
    rows = torch.arange(n)
    t = 0.8
    ids = cs.draw(x, rows, x.amax(-1), torch.full((n,), 1 / t), 1.0 - torch.rand(n, 1, generator=g),
                  64)[:, 0]
    freq = torch.bincount(ids, minlength=384).float() / n
    ref = (logits[0] / t).softmax(-1)
    assert freq[100:200].sum() == 0
    assert torch.allclose(freq, ref, atol=0.01), (freq - ref).abs().max()


def test_draw_row_without_weight_says_so():
    x = torch.full((2, 64), -INF)
    x[1, 3] = 0.0
    ids = cs.draw(x, torch.tensor([0, 1]), torch.tensor([-INF, 0.0]), torch.ones(2),
                  torch.ones(2, 2), 16)
    assert ids.tolist() == [[-1, -1], [3, 3]]


@pytest.mark.parametrize("width", WIDTHS)
def test_row_logsumexp_equals_torch(width):
    x = rows_with_edges(width, 200 + width)
    got, want = cs.row_logsumexp(x), x.logsumexp(-1)
    assert torch.equal(got.isnan(), want.isnan())
    fine = ~want.isnan()
    torch.testing.assert_close(got[fine], want[fine], rtol=2e-6, atol=2e-6)


def test_sampler_logprobs_through_the_cpp_passes_equal_log_softmax(monkeypatch):
    """Chosen and top logprobs (greedy, so the chosen one is the top one) through the C++
    passes and through log_softmax + topk: equal within float rounding, same ids."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 3000, generator=g) * 4
    logits[3, 100:] = float("-inf")
    batch = batch_for(5, temperature=torch.zeros(5), all_greedy=True, max_num_logprobs=6,
                      num_logprobs=[6, 0, None, 6, 3])
    fast = sampler_mod.Sampler()(logits.clone(), batch).logprobs
    monkeypatch.setattr(cs, "usable", lambda x: False)
    slow = sampler_mod.Sampler()(logits.clone(), batch).logprobs
    for a, b in zip(fast, slow):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert a[0] == pytest.approx(b[0], abs=1e-5)
        assert [t for t, _ in a[1]] == [t for t, _ in b[1]]
        assert [v for _, v in a[1]] == pytest.approx([v for _, v in b[1]], abs=1e-5)
        if a[1]:
            assert a[0] == a[1][0][1]
