"""Prompt logprobs (vLLM's `prompt_logprobs`) against HF transformers' log_softmax
in fp32: on a tiny random Llama (fast) and on the real default model (slow),
alone, in a mixed batch, split by chunked prefill, recomputed after preemption,
and next to a prefix-cache hit (which a scoring request bypasses, as vLLM)."""
from __future__ import annotations

import pytest
import torch

from formwork import LLM, SamplingParams
from formwork.core.step_hooks import StepHooks
from formwork.gpu.sampler import score_prompt

K = 3
TOL = 1e-4


def test_params_validation():
    with pytest.raises(ValueError, match="^prompt_logprobs:"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="^prompt_logprobs:"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="^max_tokens:"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0


def _check_entry(entry: dict, target: int, ref: torch.Tensor, k: int) -> None:
    """entry: {token_id: Logprob} of one position; ref: [V] reference logprobs."""
    t = float(ref[target])
    assert entry[target].logprob == pytest.approx(t, abs=TOL)
    # the rank is 1 + the tokens more likely, up to near-ties
    lo, hi = int((ref > t + TOL).sum()) + 1, int((ref > t - TOL).sum()) + 1
    assert lo <= entry[target].rank <= hi, (entry[target].rank, lo, hi)
    top = sorted((lp for tid, lp in entry.items() if lp.rank <= k), key=lambda lp: lp.rank)
    if entry[target].rank > k:
        assert len(entry) == k + 1
    assert [lp.rank for lp in top] == list(range(1, k + 1))
    want = ref.topk(k).values
    assert torch.allclose(torch.tensor([lp.logprob for lp in top]), want, atol=TOL)
    for tid, lp in entry.items():
        assert lp.logprob == pytest.approx(float(ref[tid]), abs=TOL)


def check_prompt_logprobs(plps, ids: list[int], ref: torch.Tensor, k: int = K) -> None:
    """plps: RequestOutput.prompt_logprobs; ref: [P, V] HF logprobs of each position's next token."""
    assert len(plps) == len(ids) and plps[0] is None
    for p in range(1, len(ids)):
        _check_entry(plps[p], ids[p], ref[p - 1], k)


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0]
    return logits.float().log_softmax(-1)


def test_score_prompt_matches_log_softmax():
    torch.manual_seed(0)
    w = torch.randn(50, 8)
    hidden = torch.randn(7, 8)
    targets = [3, 0, 49, 7, 7, 12, 30]
    got = score_prompt(lambda h: h @ w.T, hidden, targets, 4, rows_per_chunk=3)
    ref = (hidden @ w.T).log_softmax(-1)
    for e, t, r in zip(got, targets, ref):
        assert e.token.token_id == t and e.token.logprob == pytest.approx(float(r[t]), abs=1e-5)
        assert e.rank == int((r > r[t]).sum()) + 1
        assert [a.token_id for a in e.top] == r.topk(4).indices.tolist()
    assert all(e.top == [] for e in score_prompt(lambda h: h @ w.T, hidden, targets, 0))


# ---- tiny random Llama (fast) ------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def _gen(llm, prompts, **kw):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**kw),
                        use_tqdm=False)


def test_tiny_chunked_batched_and_scoring_only(tiny_model_dir, tiny_hf):
    prompts = [_ids(37, 1), _ids(5, 2), _ids(1, 3)]
    llm = LLM(str(tiny_model_dir), engine_process=False, dtype="float32", num_kv_blocks=64, block_size=8,
              max_num_batched_tokens=16,             # 37 tokens: three chunks, odd boundaries
              step_hooks=StepHooks(check_invariants=True))
    outs = _gen(llm, prompts, temperature=0, max_tokens=3, prompt_logprobs=K)
    for o, ids in zip(outs, prompts):
        check_prompt_logprobs(o.prompt_logprobs, ids, hf_logprobs(tiny_hf, ids))
        assert len(o.outputs[0].token_ids) == 3
    plain = _gen(llm, prompts[:1], temperature=0, max_tokens=3)[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == outs[0].outputs[0].token_ids
    # max_tokens=0: scored, nothing generated; n=2 children each carry the same prompt
    score = _gen(llm, prompts[:1], max_tokens=0, prompt_logprobs=0, n=2)[0]
    assert [(c.token_ids, c.finish_reason) for c in score.outputs] == [([], "length")] * 2
    check_prompt_logprobs(score.prompt_logprobs, prompts[0], hf_logprobs(tiny_hf, prompts[0]), 0)
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks + kv.num_cached_blocks == kv.num_blocks
    llm.shutdown()


def test_tiny_prefix_cache_bypassed_then_reused(tiny_model_dir, tiny_hf):
    shared = _ids(40, 4)
    ids = shared + _ids(9, 5)
    llm = LLM(str(tiny_model_dir), engine_process=False, dtype="float32", num_kv_blocks=64, block_size=8)
    _gen(llm, [shared], temperature=0, max_tokens=2)           # caches 4 full blocks
    hits = llm.get_stats().prefix_cache_hits
    scored = _gen(llm, [ids], temperature=0, max_tokens=2, prompt_logprobs=K)[0]
    assert scored.num_cached_tokens == 0 and llm.get_stats().prefix_cache_hits == hits
    check_prompt_logprobs(scored.prompt_logprobs, ids, hf_logprobs(tiny_hf, ids))
    again = _gen(llm, [ids], temperature=0, max_tokens=2)[0]   # its blocks serve later requests
    assert again.num_cached_tokens >= 40
    assert again.outputs[0].token_ids == scored.outputs[0].token_ids
    llm.shutdown()


def test_tiny_preempted_during_prefill(tiny_model_dir, tiny_hf):
    # 12 blocks x 8: a long decode (A) and a long scored prompt (B) cannot both fit; B,
    # the later arrival, is preempted in the middle of its chunked prefill and recomputed.
    a, b = _ids(8, 6), _ids(80, 7)
    llm = LLM(str(tiny_model_dir), engine_process=False, dtype="float32", num_kv_blocks=12, block_size=8,
              max_num_batched_tokens=9, enable_prefix_caching=False,
              step_hooks=StepHooks(check_invariants=True))
    sched = llm.engine.scheduler
    preempted_in_prefill = []
    step = llm.engine.step

    def traced():
        before = sched.num_preemptions
        out = step()
        if sched.num_preemptions > before:
            req = next((r for r in sched.waiting if r.num_output_tokens == 0), None)
            preempted_in_prefill.append(req is not None)
        return out

    llm.engine.step = traced
    outs = llm.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}],
                        [SamplingParams(temperature=0, max_tokens=60, min_tokens=60),
                         SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K)],
                        use_tqdm=False)
    assert any(preempted_in_prefill), "B was never preempted during its prefill"
    assert outs[0].prompt_logprobs is None and len(outs[0].outputs[0].token_ids) == 60
    check_prompt_logprobs(outs[1].prompt_logprobs, b, hf_logprobs(tiny_hf, b))
    llm.shutdown()


# ---- the real default model (slow) -------------------------------------------------------

PROMPTS = [
    "The capital of France is Paris. The capital of Italy is",
    "In 1969 the first humans landed on the Moon. The mission was called Apollo 11 and the crew "
    "consisted of Neil Armstrong, Buzz Aldrin and Michael Collins.",
]


@pytest.fixture(scope="module")
def real_hf(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    ids = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    return ids, model


@pytest.mark.slow
def test_real_model_alone_chunked_and_prefix_shared(real_hf):
    ids, model = real_hf
    llm = LLM(dtype="float32", num_kv_blocks=128, max_num_batched_tokens=16,  # chunks of <= 16
              engine_process=False, step_hooks=StepHooks(check_invariants=True))
    for o, i in zip(_gen(llm, ids, temperature=0, max_tokens=2, prompt_logprobs=K), ids):
        check_prompt_logprobs(o.prompt_logprobs, i, hf_logprobs(model, i))
        assert o.prompt_logprobs[1][i[1]].decoded_token == llm.tokenizer.decode([i[1]])
    # a request sharing the first blocks of a cached prompt still scores every position
    shared = ids[1][:32] + ids[0]
    hits = llm.get_stats().prefix_cache_hits
    o = _gen(llm, [shared], temperature=0, max_tokens=1, prompt_logprobs=K)[0]
    assert o.num_cached_tokens == 0 and llm.get_stats().prefix_cache_hits == hits
    check_prompt_logprobs(o.prompt_logprobs, shared, hf_logprobs(model, shared))
    assert _gen(llm, [shared], temperature=0, max_tokens=1)[0].num_cached_tokens >= 32
    llm.shutdown()
