"""Every per-request value that reaches a tensor or an int64 is checked at the
boundary (issue 13): a bad request fails alone, with the parameter named."""
from __future__ import annotations

import math
import re

import pytest

from formwork import LLM, SamplingParams
from formwork.schemas.sampling import MAX_N, check_token_ids


@pytest.mark.parametrize("field,value,words", [
    ("temperature", math.nan, "finite"), ("top_p", math.inf, "finite"),
    ("repetition_penalty", -math.inf, "finite"), ("presence_penalty", math.nan, "finite"),
    ("n", MAX_N + 1, "128"), ("n", 0, "128"), ("seed", 2**63, "2^63"), ("seed", -(2**63) - 1, "2^63"),
    ("stop_token_ids", [2**70], "token ids"), ("stop_token_ids", [-1], "token ids"),
])
def test_out_of_range_values_are_refused_naming_the_field(field, value, words):
    with pytest.raises(ValueError, match=f"^{field}: .*{re.escape(words)}"):
        SamplingParams(**{field: value})


def test_seed_plus_n_stays_an_int64():
    SamplingParams(seed=2**63 - 1 - 4, n=4)
    with pytest.raises(ValueError, match="^seed: "):
        SamplingParams(seed=2**63 - 2, n=4)


def test_negative_seeds_are_int64_seeds_too(tiny_llm):
    """vLLM takes any int64 seed (a client's seed=-5 was a 400): a negative seed
    reproduces its draws and draws apart from its positive twin."""
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    run = lambda seed: tiny_llm.generate(prompt, SamplingParams(  # noqa: E731
        temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert run(-5) == run(-5) != run(5)
    assert run(-(2**63)) == run(-(2**63))


def test_token_ids_against_the_vocabulary():
    check_token_ids(SamplingParams(stop_token_ids=[0, 99]), vocab_size=100)
    with pytest.raises(ValueError, match="^stop_token_ids: token id 100 outside"):
        check_token_ids(SamplingParams(stop_token_ids=[5, 100]), vocab_size=100)


@pytest.mark.parametrize("engine_process", [False, True])
def test_llm_refuses_before_admitting_anything(tiny_model_dir, engine_process):
    llm = LLM(str(tiny_model_dir), engine_process=engine_process, dtype="float32",
              num_kv_blocks=32)
    try:
        good = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        bad = SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=[10**6])
        prompts = [{"prompt_token_ids": [5, 6, 7]}] * 2
        with pytest.raises(ValueError, match="stop_token_ids"):
            llm.generate(prompts, [good, bad], use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        out = llm.generate(prompts, [good, good], use_tqdm=False)      # still serving
        assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]
    finally:
        llm.shutdown()
