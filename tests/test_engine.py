"""EngineCore + offline LLM on a tiny random Llama (fast): the step contract,
aborts inside a step, bad input, block accounting, sampling options."""
import pytest

from formwork import LLM, SamplingParams
from formwork.core.step_hooks import StepHooks
from formwork.schemas.engine import EngineCoreRequest, FinishReason

GREEDY = dict(temperature=0, ignore_eos=True)
HOOKS = StepHooks(check_invariants=True)        # the `llm` fixture's engine's


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), engine_process=False, dtype="float32", num_kv_blocks=64,
              block_size=16, max_num_batched_tokens=64, max_num_seqs=8, step_hooks=HOOKS)
    yield llm
    llm.shutdown()


def assert_idle(llm):
    kv = llm.engine.kv_manager
    kv.check_invariants()
    assert not llm.engine.has_unfinished_requests()
    assert kv.num_free_blocks + kv.num_cached_blocks == kv.num_blocks   # free + cached == total


def test_step_order_trace(llm):
    trace = []
    eng = llm.engine
    HOOKS.trace = trace.append
    try:
        eng.add_request(EngineCoreRequest(request_id="t", prompt_token_ids=[5, 6, 7],
                                          sampling_params=SamplingParams(max_tokens=2, **GREEDY)))
        eng.step()
    finally:
        HOOKS.trace = None
    assert trace == ["schedule", "execute", "grammar", "wait", "aborts", "update"]
    while eng.has_unfinished_requests():
        eng.step()
    assert_idle(llm)


def test_abort_during_step_emits_no_token_and_frees_blocks_once(llm):
    eng = llm.engine
    sp = SamplingParams(max_tokens=50, **GREEDY)
    for rid in ("a", "b"):
        eng.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=list(range(10, 40)),
                                          sampling_params=sp))
    eng.step()                                             # both prefilled, first token each
    HOOKS.trace = lambda what: eng.abort_requests(["a"]) if what == "grammar" else None
    try:
        outs = eng.step().outputs
    finally:
        HOOKS.trace = None
    by_id = {o.request_id: o for o in outs}
    assert by_id["a"].finish_reason == FinishReason.ABORT and by_id["a"].new_token_ids == []
    assert by_id["b"].new_token_ids and by_id["b"].finish_reason is None
    later = []
    while eng.has_unfinished_requests():
        later += eng.step().outputs
    assert all(o.request_id == "b" for o in later)
    eng.abort_requests(["a", "a", "nope"])                 # repeated / unknown aborts are harmless
    eng.step()
    assert_idle(llm)


def test_outputs_identical_alone_batched_chunked_cached(llm, tiny_model_dir):
    prompts = [list(range(100, 100 + n)) for n in (3, 17, 40, 70)]
    sp = SamplingParams(max_tokens=12, **GREEDY)
    alone = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids
             for p in prompts]
    batched = [o.outputs[0].token_ids for o in
               llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
    assert batched == alone
    hits_before = llm.get_stats().prefix_cache_hits
    again = [o.outputs[0].token_ids for o in
             llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
    assert again == alone
    assert llm.get_stats().prefix_cache_hits > hits_before
    assert_idle(llm)


def test_preemption_recomputes_identically(tiny_model_dir):
    prompts = [list(range(200 + 7 * i, 230 + 7 * i)) for i in range(6)]
    sp = SamplingParams(max_tokens=40, **GREEDY)
    big = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in big.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                        use_tqdm=False)]
    big.shutdown()
    small = LLM(str(tiny_model_dir), engine_process=False, dtype="float32", num_kv_blocks=14, block_size=16,
                enable_prefix_caching=False, step_hooks=StepHooks(check_invariants=True))
    got = [o.outputs[0].token_ids for o in small.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                         use_tqdm=False)]
    assert small.get_stats().num_preemptions > 0
    assert got == want
    assert_idle(small)
    small.shutdown()


@pytest.mark.parametrize("bad, param", [
    (dict(prompt=""), "prompt"),
    (dict(prompt={"prompt_token_ids": [1] * 600}), "prompt"),
    (dict(prompt={"prompt_token_ids": [10 ** 9]}), "prompt_token_ids"),
])
def test_bad_prompts_raise_and_engine_keeps_serving(llm, bad, param):
    with pytest.raises(ValueError, match=param):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}, bad["prompt"]],
                     SamplingParams(max_tokens=2), use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, **GREEDY),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert_idle(llm)


@pytest.mark.parametrize("kw, param", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(n=0), "n"),
])
def test_bad_sampling_params_name_the_parameter(kw, param):
    with pytest.raises(ValueError, match=param):
        SamplingParams(**kw)


def test_max_tokens_length_and_stop_token(llm):
    out = llm.generate([{"prompt_token_ids": [4, 5, 6]}], SamplingParams(max_tokens=5, **GREEDY),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    stop_tok = out.token_ids[2]
    out2 = llm.generate([{"prompt_token_ids": [4, 5, 6]}],
                        SamplingParams(max_tokens=5, stop_token_ids=[stop_tok], **GREEDY),
                        use_tqdm=False)[0].outputs[0]
    first = out.token_ids.index(stop_tok)
    assert out2.finish_reason == "stop" and out2.stop_reason == stop_tok
    assert out2.token_ids == out.token_ids[:first + 1]


def test_stop_string_truncates_text_and_frees_request(llm):
    base = llm.generate([{"prompt_token_ids": [4, 5, 6]}], SamplingParams(max_tokens=20, **GREEDY),
                        use_tqdm=False)[0].outputs[0]
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    if not stop.strip():
        pytest.fail(f"degenerate generated text {text!r}")
    out = llm.generate([{"prompt_token_ids": [4, 5, 6]}],
                       SamplingParams(max_tokens=20, stop=[stop], **GREEDY), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    assert_idle(llm)


def test_n_seeded_sampling_reproducible_and_logprobs(llm):
    # top_k: over the random model's near-flat 49k-token distribution a draw's
    # neighbours are ~2e-5 apart in the CDF, so float noise from another batch shape
    # (seen on a CI CPU in fp32) can move it; over 5 tokens it cannot
    sp = SamplingParams(n=3, temperature=1.0, top_k=5, seed=7, max_tokens=8, logprobs=2,
                        ignore_eos=True)
    a = llm.generate([{"prompt_token_ids": [9, 9, 9]}], sp, use_tqdm=False)[0]
    b = llm.generate([{"prompt_token_ids": [9, 9, 9]}, {"prompt_token_ids": [1, 2]}], [sp, sp],
                     use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    for c in a.outputs:
        assert len(c.logprobs) == 8
        for lp, tok in zip(c.logprobs, c.token_ids):      # vLLM's shape: the pick, then the top 2
            assert next(iter(lp)) == tok and lp[tok].logprob <= 0 and 2 <= len(lp) <= 3
            assert {1, 2} <= {v.rank for v in lp.values()}
    assert_idle(llm)


def test_min_tokens_masks_eos_and_stop_ids(llm):
    free = llm.generate([{"prompt_token_ids": [4, 5, 6]}], SamplingParams(max_tokens=4, **GREEDY),
                        use_tqdm=False)[0].outputs[0]
    first = free.token_ids[0]
    out = llm.generate([{"prompt_token_ids": [4, 5, 6]}],
                       SamplingParams(max_tokens=6, min_tokens=4, temperature=0, stop_token_ids=[first]),
                       use_tqdm=False)[0].outputs[0]
    assert first not in out.token_ids[:4]           # masked, not merely ignored
    assert out.token_ids[0] != first
