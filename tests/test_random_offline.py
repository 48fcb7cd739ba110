"""Random batches through the offline `LLM.generate` (the tiny random-weight model,
a KV pool small enough to preempt and a token budget small enough to chunk
prefills): sampling fields, n, min_tokens, stop strings and stop token ids,
logprobs and prompt logprobs, bans, skip_special_tokens, constraints, prompts as
text and as token ids. Whatever the mix, what vLLM's API promises holds for every
output: n completions, max_tokens, "length" only at max_tokens (or when
budget-aware decoding closed a constrained output), min_tokens, no stop string in
the text past the first min_tokens tokens, no stop token inside, logprobs of
vLLM's shape that add up to cumulative_logprob, prompt logprobs per prompt token,
the text the tokens decode to (less the token that ended the output), constrained
outputs that validate. Found this way: a JSON output followed by `<|im_end|>`
under skip_special_tokens=False, and stop strings that cut before min_tokens."""
from __future__ import annotations

import json
import math
import random
import re

import jsonschema
import pytest

from formwork import LLM, SamplingParams, StructuredOutputsParams

ROUNDS = 60
SCHEMAS = [{"type": "object", "properties": {"a": {"type": "integer"},
                                             "b": {"type": "string", "maxLength": 6}},
            "required": ["a", "b"], "additionalProperties": False},
           {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 4}]
CONSTRAINTS = [{"json": SCHEMAS[0]}, {"json": SCHEMAS[1]}, {"regex": "[a-c]{1,5}"},
               {"choice": ["yes", "no", "maybe"]}]
WORDS = ["the", "cat", "Hello", "world", "a", "b", "json", "{", "1"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), engine_process=False, dtype="float32", num_kv_blocks=48,
              block_size=8, max_num_seqs=8, max_model_len=512, max_num_batched_tokens=64)
    yield llm
    llm.shutdown()


def random_params(r: random.Random) -> SamplingParams:
    kw: dict = {"max_tokens": r.choice([1, 2, 5, 17, 40])}
    for key, p, values in [
            ("temperature", 0.5, [0.0, 0.5, 1.0, 2.0]), ("seed", 0.3, range(11)),
            ("n", 0.3, [1, 2, 3]), ("top_k", 0.2, [1, 3, 50]), ("top_p", 0.2, [0.3, 0.9]),
            ("min_p", 0.2, [0.05, 0.5]), ("include_stop_str_in_output", 0.2, [True]),
            ("logprobs", 0.3, [0, 1, 5]), ("prompt_logprobs", 0.2, [0, 2]),
            ("ignore_eos", 0.2, [True]), ("presence_penalty", 0.15, [1.0]),
            ("repetition_penalty", 0.15, [1.3]), ("skip_special_tokens", 0.15, [False])]:
        if r.random() < p:
            kw[key] = r.choice(list(values))
    if r.random() < 0.2:
        kw["min_tokens"] = r.randint(0, kw["max_tokens"])
    if r.random() < 0.3:
        kw["stop"] = r.sample([" the", "a", "\n", "e", "xyz", ".", "ab"], r.randint(1, 2))
    if r.random() < 0.2:
        kw["stop_token_ids"] = r.sample(range(100, 2000), 3)
    if r.random() < 0.1:
        kw["bad_words"] = r.sample(["the", " the", "Hello", "ing"], 2)
    if r.random() < 0.2:
        kw["structured_outputs"] = StructuredOutputsParams(**r.choice(CONSTRAINTS))
    kw.setdefault("seed", r.randrange(1000))     # one run repeats the next on a machine
    return SamplingParams(**kw)


def random_prompt(r: random.Random):
    if r.random() < 0.3:
        return {"prompt_token_ids": [r.randint(3, 40000) for _ in range(r.randint(1, 60))]}
    return " ".join(r.choice(WORDS) for _ in range(r.randint(1, 80)))


def check_prompt_logprobs(p: SamplingParams, prompt_ids: list[int], plp) -> None:
    assert plp is not None and len(plp) == len(prompt_ids) and plp[0] is None
    for pos in range(1, len(prompt_ids)):
        assert prompt_ids[pos] in plp[pos]
        assert len(plp[pos]) in (p.prompt_logprobs, p.prompt_logprobs + 1)


def check_logprobs(p: SamplingParams, c) -> None:
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    total = 0.0
    for t, d in zip(c.token_ids, c.logprobs):
        assert t in d
        if p.structured_outputs is not None and len(d) == 1 and d[t].logprob == 0 \
                and d[t].rank == 1:
            continue        # a token budget-aware closing put in (README: logprob 0, rank 1)
        assert len(d) in (p.logprobs, p.logprobs + 1)
        assert all(v.logprob <= 1e-6 for v in d.values())
        total += d[t].logprob
    assert c.cumulative_logprob is not None
    if math.isfinite(total):
        assert c.cumulative_logprob == pytest.approx(total, rel=1e-3, abs=1e-3)


def check_completion(p: SamplingParams, c, tokenizer) -> None:
    ids = list(c.token_ids)
    assert c.finish_reason in ("stop", "length")
    assert len(ids) <= p.max_tokens
    if p.structured_outputs is None:           # budget-aware closing ends early "length"
        assert c.finish_reason == "stop" or len(ids) == p.max_tokens
        assert len(ids) >= p.min_tokens
    if p.stop and not p.include_stop_str_in_output:
        written = tokenizer.decode(ids[:p.min_tokens], skip_special_tokens=p.skip_special_tokens)
        assert not any(s in c.text[len(written):] for s in p.stop), c.text
    if p.stop_token_ids:
        assert not set(ids[:-1]) & set(p.stop_token_ids)
    if p.logprobs is not None:
        check_logprobs(p, c)
    if c.finish_reason == "stop" and ids and not p.include_stop_str_in_output and (
            c.stop_reason is None and ids[-1] == tokenizer.eos_token_id
            or isinstance(c.stop_reason, int) and ids[-1] == c.stop_reason):
        ids = ids[:-1]                          # the token that ended it is not written
    if c.stop_reason is None or isinstance(c.stop_reason, int):
        # the tokens decoded: an unfinished character at the end too (it waited with
        # its token's text, which the output then lost, before the end flushed it)
        text = tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
        assert c.text == text, (c.text, text)
    so = p.structured_outputs
    if so is not None and c.finish_reason == "stop" and c.stop_reason is None \
            and not (p.include_stop_str_in_output and not p.skip_special_tokens):
        if so.json is not None:
            jsonschema.validate(json.loads(c.text), so.json)
        elif so.regex is not None:
            assert re.fullmatch(so.regex, c.text), c.text
        else:
            assert c.text in so.choice


def test_random_batches_keep_vllms_promises(llm):
    tokenizer = llm.get_tokenizer()
    r = random.Random(20261207)
    for _ in range(ROUNDS):
        prompts = [random_prompt(r) for _ in range(r.randint(1, 10))]
        params = [random_params(r) for _ in prompts]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for p, o in zip(params, outs):
            where = f"{p} -> {[(c.text, c.token_ids, c.finish_reason) for c in o.outputs]}"
            try:
                assert len(o.outputs) == p.n
                if p.prompt_logprobs is not None:
                    check_prompt_logprobs(p, list(o.prompt_token_ids), o.prompt_logprobs)
                for c in o.outputs:
                    check_completion(p, c, tokenizer)
            except AssertionError as e:
                raise AssertionError(f"{e}\n{where[:1500]}") from e
    stats = llm.get_stats()
    assert stats.num_preemptions > 0                   # the mix did run out of KV blocks
    assert stats.kv_free_blocks == stats.kv_total_blocks and stats.num_running == 0
