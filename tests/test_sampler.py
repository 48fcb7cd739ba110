"""Sampler against plain references: masks before everything, penalties,
top-k / top-p / min-p, per-request seeds independent of the batch, logprobs."""
import math

import numpy as np
import pytest
import torch

from formwork.gpu.sampler import Sampler, SamplingBatch, apply_penalties

V = 50


def batch_for(n, **kw):
    base = dict(temperature=torch.zeros(n), top_p=None, top_k=None, min_p=None, all_greedy=True,
                seeds=[None] * n, presence=None, frequency=None, repetition=None,
                output_token_ids=None, all_token_ids=None, max_num_logprobs=None, num_logprobs=[None] * n)
    base.update(kw)
    return SamplingBatch(**base)


def pack(allowed_rows, vocab):
    """Packed int32 bitmask (bit b of word w = token 32*w+b allowed)."""
    words = (vocab + 31) // 32
    out = np.zeros((len(allowed_rows), words), dtype=np.uint32)
    for r, allowed in enumerate(allowed_rows):
        for t in allowed:
            out[r, t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(out.view(np.int32))


def test_mask_applied_before_greedy_and_logprobs():
    """processed_logprobs: after the mask, and the ruled-out entries (-inf) left
    out -- row 0 allows 3 tokens, so 3 top entries of the 5 asked, all finite."""
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    allowed = [[3, 7, 40], [0, 31, 32, 45, 47, 49]]
    mask = pack(allowed, V)
    rows = torch.tensor([0, 2])
    b = batch_for(3, max_num_logprobs=5, num_logprobs=[5, None, 5])
    ref = logits.clone()
    out = Sampler("processed_logprobs")(logits, b, mask, rows)
    for r, a in zip([0, 2], allowed):
        want = max(a, key=lambda t: ref[r, t].item())
        assert out.token_ids[r] == want
        top = out.logprobs[r][1]
        assert len(top) == min(5, len(a)) and {t for t, _ in top} <= set(a)
        assert all(math.isfinite(v) for _, v in top)
        lp = torch.log_softmax(ref[r, a], -1)
        assert out.logprobs[r][0] == pytest.approx(lp[a.index(want)].item(), abs=1e-5)
        assert out.logprobs[r][2] == 1                    # greedy under the mask: the best allowed
    assert out.token_ids[1] == int(ref[1].argmax())       # unmasked row untouched


def test_raw_logprobs_are_the_models_own_and_the_mask_still_rules():
    """raw_logprobs (the default, as vLLM): the model's distribution before the mask,
    so constrained requests get finite, unmasked numbers; the pick still obeys the mask."""
    torch.manual_seed(0)
    logits = torch.randn(2, V)
    allowed = [[3, 7, 40]]
    ref = logits.clone()
    b = batch_for(2, max_num_logprobs=4, num_logprobs=[4, 4])
    out = Sampler()(logits, b, pack(allowed, V), torch.tensor([0]))
    want = max(allowed[0], key=lambda t: ref[0, t].item())
    assert out.token_ids[0] == want
    full = torch.log_softmax(ref, -1)
    assert out.logprobs[0][0] == pytest.approx(full[0, want].item(), abs=1e-5)
    top_vals, top_idx = full[0].topk(4)
    assert [t for t, _ in out.logprobs[0][1]] == top_idx.tolist()
    assert all(math.isfinite(v) for _, v in out.logprobs[0][1])
    # the pick's rank in the model's own distribution: the mask pushed it down the list
    assert out.logprobs[0][2] == int((ref[0] > ref[0, want]).sum()) + 1 > 1
    assert out.logprobs[1][2] == 1                          # the unmasked greedy row's pick
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler("raw_logits")


def test_seeded_rows_do_not_depend_on_batch():
    torch.manual_seed(1)
    row = torch.randn(1, V)
    def draw(batch_rows, seed_pos):
        logits = torch.randn(batch_rows, V)
        logits[seed_pos] = row[0]
        seeds = [None] * batch_rows
        seeds[seed_pos] = 1234
        b = batch_for(batch_rows, temperature=torch.ones(batch_rows), all_greedy=False, seeds=seeds)
        return Sampler()(logits, b).token_ids[seed_pos]
    got = {draw(n, pos) for n, pos in [(1, 0), (4, 2), (9, 8), (3, 0)]}
    assert len(got) == 1


def test_sampling_distribution_matches_softmax_with_top_k_top_p():
    torch.manual_seed(2)
    logits = torch.randn(1, 8) * 2
    k, p, temp = 5, 0.8, 0.7
    # reference distribution
    scaled = logits[0] / temp
    order = scaled.argsort(descending=True)
    keep = order[:k]
    probs = scaled[keep].softmax(-1)
    cum = probs.cumsum(0) - probs
    keep = keep[cum < p]
    ref = torch.zeros(8)
    ref[keep] = (scaled[keep]).softmax(-1)
    n = 6000
    b = batch_for(n, temperature=torch.full((n,), temp), all_greedy=False,
                  top_k=torch.full((n,), k), top_p=torch.full((n,), p))
    toks = Sampler()(logits.repeat(n, 1), b).token_ids
    freq = torch.bincount(torch.tensor(toks), minlength=8).float() / n
    assert (freq[ref == 0] == 0).all()
    assert torch.allclose(freq, ref, atol=0.03)


@pytest.mark.parametrize("vocab", [1000, 997, 4096])
def test_draw_matches_the_masked_softmax_across_blocks(vocab):
    """The two-level inverse-CDF draw (block sums, then one block) against the
    softmax over the allowed tokens: scattered allowed tokens in far blocks, whole
    blocks without any (probability 0), a prime vocabulary (blocks of one token);
    a masked token is never drawn."""
    gen = torch.Generator().manual_seed(5)
    allowed = sorted({3, 4, vocab // 2, vocab // 2 + 1, vocab - 2, vocab - 1}
                     | set(torch.randint(0, vocab, (6,), generator=gen).tolist()))
    logits = torch.randn(1, vocab, generator=gen) * 2
    ref = torch.full((vocab,), float("-inf"))
    ref[allowed] = logits[0, allowed]
    ref = ref.softmax(-1)
    n = 20000
    b = batch_for(n, temperature=torch.ones(n), all_greedy=False)
    torch.manual_seed(6)
    toks = Sampler()(logits.repeat(n, 1), b, pack([allowed] * n, vocab), torch.arange(n)).token_ids
    freq = torch.bincount(torch.tensor(toks), minlength=vocab).float() / n
    assert set(toks) <= set(allowed)
    assert torch.allclose(freq, ref, atol=0.015), (freq[allowed], ref[allowed])


def test_min_p_excludes_unlikely_tokens():
    logits = torch.tensor([[5.0, 4.9, 0.0, -1.0]])
    n = 500
    b = batch_for(n, temperature=torch.ones(n), all_greedy=False, min_p=torch.full((n,), 0.5))
    toks = set(Sampler()(logits.repeat(n, 1), b).token_ids)
    assert toks == {0, 1}


def test_penalties_against_reference():
    torch.manual_seed(3)
    logits = torch.randn(2, V)
    outs = [[1, 1, 5], []]
    alls = [[9, 1, 1, 5], [9]]
    b = batch_for(2, presence=torch.tensor([0.5, 0.5]), frequency=torch.tensor([0.25, 0.25]),
                  repetition=torch.tensor([1.3, 1.3]), output_token_ids=outs, all_token_ids=alls)
    got = logits.clone()
    apply_penalties(got, b)
    ref = logits.clone()
    for r in range(2):
        for t in set(alls[r]):
            ref[r, t] = ref[r, t] / 1.3 if ref[r, t] > 0 else ref[r, t] * 1.3
        for t in set(outs[r]):
            ref[r, t] -= 0.25 * outs[r].count(t) + 0.5
    assert torch.allclose(got, ref, atol=1e-6)


def test_temperature_zero_rows_stay_greedy_in_mixed_batch():
    torch.manual_seed(4)
    logits = torch.randn(4, V)
    b = batch_for(4, temperature=torch.tensor([0.0, 1.0, 0.0, 2.0]), all_greedy=False)
    out = Sampler()(logits.clone(), b).token_ids
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
