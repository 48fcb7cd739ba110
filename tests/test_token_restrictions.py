"""vLLM's allowed_token_ids and bad_words, and bans against a grammar.

The sampler bans what allowed_token_ids leaves out and the last token of a bad
word whose other tokens end the output; a row whose bans (logit_bias -100
included) leave no token the grammar allows gets its logits back under the
grammar alone, so a constrained output still validates; a restricted request
takes no jump-forward, so every output token is sampled under its bans. Checked
on the sampler (exact rows), through the offline `LLM` on the tiny model, and
the request checks naming the field.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from formwork import SamplingParams, StructuredOutputsParams
from formwork.gpu.sampler import (Sampler, SamplingBatch, allowed_tensors, bad_word_bans,
                                  logit_bias_tensors, mask_can_wait)
from formwork.schemas.errors import ParamError
from formwork.schemas.sampling import check_token_ids, resolve_bad_words

V = 64


def _batch(n, greedy=True, **kw) -> SamplingBatch:
    base = dict(temperature=torch.zeros(n) if greedy else torch.ones(n), top_p=None, top_k=None,
                min_p=None, all_greedy=greedy, seeds=[None] * n, presence=None, frequency=None,
                repetition=None, output_token_ids=None, all_token_ids=None,
                max_num_logprobs=None, num_logprobs=[None] * n)
    return SamplingBatch(**(base | kw))


def _mask(allowed: list[int]) -> torch.Tensor:
    m = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    for t in allowed:
        m[0, t // 32] |= 1 << (t % 32)
    return m


# ---- the sampler ------------------------------------------------------------------------

def test_allowed_token_ids_restrict_only_their_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    best = logits.argmax(-1)
    allowed = [[int(best[0]) ^ 1, 40, 41], None, [7]]
    batch = _batch(3, allowed=allowed_tensors(allowed, "cpu"), restricted=torch.tensor([0, 2]))
    out = Sampler()(logits.clone(), batch).token_ids
    assert out[0] == max(allowed[0], key=lambda t: float(logits[0, t]))   # best allowed
    assert out[1] == int(best[1])                                         # untouched
    assert out[2] == 7
    # sampled: never outside the set, and every member comes out (a flat row)
    hot = _batch(1, greedy=False, allowed=allowed_tensors([[3, 9, 60]], "cpu"),
                 restricted=torch.tensor([0]))
    seen = {Sampler()(torch.zeros(1, V), hot).token_ids[0] for _ in range(200)}
    assert seen == {3, 9, 60}
    assert allowed_tensors([None, []], "cpu") is None


def test_bad_word_bans_follow_the_output():
    seqs = [[5], [7, 8], [1, 2, 3]]
    assert bad_word_bans([(seqs, [])]) == [(0, 5)]                 # one-token: always
    assert bad_word_bans([(seqs, [9, 7])]) == [(0, 5), (0, 8)]     # after 7: 8 banned
    assert bad_word_bans([(seqs, [1, 2])]) == [(0, 5), (0, 3)]
    assert bad_word_bans([(seqs, [2, 1])]) == [(0, 5)]             # order matters
    assert bad_word_bans([(None, [7]), (seqs, [7])]) == [(1, 5), (1, 8)]
    logits = torch.zeros(1, V)
    logits[0, 8] = 5.0
    logits[0, 4] = 4.0
    batch = _batch(1, word_bans=bad_word_bans([(seqs, [7])]), restricted=torch.tensor([0]))
    assert Sampler()(logits.clone(), batch).token_ids == [4]


@pytest.mark.parametrize("kind", ["logit_bias", "allowed", "word_bans"])
def test_a_ban_against_the_grammar_gives_way_to_it(kind):
    """The grammar allows {3, 4} only; the ban covers both: the row gets its logits
    back under the grammar alone (its best allowed token), not an all -inf row."""
    logits = torch.zeros(1, V)
    logits[0, 4], logits[0, 3], logits[0, 20] = 2.0, 1.0, 9.0
    bans = {"logit_bias": dict(logit_bias=logit_bias_tensors([{3: -100, 4: -100}], "cpu")),
            "allowed": dict(allowed=allowed_tensors([[20, 21]], "cpu")),
            "word_bans": dict(word_bans=[(0, 3), (0, 4)])}[kind]
    batch = _batch(1, restricted=torch.tensor([0]), **bans)
    assert Sampler()(logits.clone(), batch, _mask([3, 4]), torch.tensor([0])).token_ids == [4]
    # a ban that leaves the grammar a token is kept: 4 banned alone -> 3
    one = {"logit_bias": dict(logit_bias=logit_bias_tensors([{4: -100}], "cpu")),
           "allowed": dict(allowed=allowed_tensors([[3, 20]], "cpu")),
           "word_bans": dict(word_bans=[(0, 4)])}[kind]
    batch = _batch(1, restricted=torch.tensor([0]), **one)
    assert Sampler()(logits.clone(), batch, _mask([3, 4]), torch.tensor([0])).token_ids == [3]
    # sampled rows too, and only the dead row is given back (row 1 keeps its ban)
    logits2 = torch.zeros(2, V)
    batch = _batch(2, greedy=False, restricted=torch.tensor([0, 1]),
                   allowed=allowed_tensors([[20], [5]], "cpu"))
    for _ in range(30):
        out = Sampler()(logits2.clone(), batch, _mask([3, 4]).repeat(2, 1),
                        torch.tensor([0, 1])).token_ids
        assert out[0] in (3, 4) and out[1] in (3, 4)
    batch = _batch(2, greedy=False, restricted=torch.tensor([0, 1]),
                   allowed=allowed_tensors([[20], [3]], "cpu"))
    assert all(Sampler()(logits2.clone(), batch, _mask([3, 4]).repeat(2, 1),
                         torch.tensor([0, 1])).token_ids[1] == 3 for _ in range(30))


def test_restricted_requests_take_their_mask_every_step():
    free = SamplingParams(temperature=0)
    assert mask_can_wait(free)
    for kw in (dict(allowed_token_ids=[1]), dict(logit_bias={3: -100}),
               dict(bad_words_token_ids=[[4]])):
        p = SamplingParams(temperature=0, **kw)
        assert p.restricts_tokens and not mask_can_wait(p)
    assert not SamplingParams(logit_bias={3: -99}).restricts_tokens    # a bias, not a ban


# ---- the checks ---------------------------------------------------------------------------

@pytest.mark.parametrize("kw,param,words", [
    (dict(allowed_token_ids=[]), "allowed_token_ids", "at least one"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids", "token ids"),
    (dict(allowed_token_ids=[5], logit_bias={5: -100}), "allowed_token_ids", "bans every"),
    (dict(bad_words=[""]), "bad_words", "not only spaces"),
    (dict(bad_words=["x"] * 257), "bad_words", "256"),
    (dict(bad_words=["y" * 300]), "bad_words", "256 characters"),
])
def test_bad_values_name_the_field(kw, param, words):
    with pytest.raises(ParamError) as e:
        SamplingParams(**kw)
    assert e.value.param == param and words in str(e.value)


def test_token_ids_are_checked_against_the_vocabulary():
    with pytest.raises(ParamError, match="allowed_token_ids: token id 70"):
        check_token_ids(SamplingParams(allowed_token_ids=[1, 70]), 64)
    with pytest.raises(ParamError, match="bad_words: token id 99"):
        check_token_ids(SamplingParams(bad_words_token_ids=[[1, 99]]), 64)
    check_token_ids(SamplingParams(allowed_token_ids=[63], bad_words_token_ids=[[0]]), 64)


def test_bad_words_are_tokenized_alone_and_after_a_space(tokenizer):
    p = SamplingParams(bad_words=["  Paris", "hello world"])
    resolve_bad_words(p, tokenizer)
    enc = [tokenizer.encode(t, add_special_tokens=False)
           for t in ("Paris", " Paris", "hello world", " hello world")]
    assert p.bad_words_token_ids == [e for i, e in enumerate(enc) if e not in enc[:i]]
    assert len(p.bad_words_token_ids) == 4 and len(p.bad_words_token_ids[2]) == 2
    # a word of two tokens alone and one after a space: both forms are banned (vLLM
    # keeps the spaced one only when it has as many tokens, and lets " proves" through)
    p = SamplingParams(bad_words=["proves"])
    resolve_bad_words(p, tokenizer)
    alone, spaced = (tokenizer.encode(t, add_special_tokens=False) for t in ("proves", " proves"))
    assert len(alone) == 2 and len(spaced) == 1 and p.bad_words_token_ids == [alone, spaced]
    p.bad_words = None
    resolve_bad_words(p, tokenizer)
    assert p.bad_words_token_ids is None


# ---- through the offline LLM (tiny random model) -------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm


PROMPT = [{"prompt_token_ids": [5, 6, 7, 8]}]


def _contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i:i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def test_allowed_token_ids_through_the_engine(llm):
    allowed = [11, 300, 301, 4000]
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        out = llm.generate(PROMPT, SamplingParams(max_tokens=16, ignore_eos=True, n=3,
                                                  allowed_token_ids=allowed, **kw),
                           use_tqdm=False)[0].outputs
        assert all(set(c.token_ids) <= set(allowed) for c in out), [c.token_ids for c in out]
    free = llm.generate(PROMPT, SamplingParams(max_tokens=16, ignore_eos=True, temperature=0),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert not set(free) <= set(allowed)          # the check above could fail


def test_bad_words_through_the_engine(llm):
    tok = llm.get_tokenizer()
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0)
    free = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids
    # a word of the free output that the tokenizer writes as that one token
    word = next(w for w in (tok.decode([t]).strip() for t in free)
                if w and any(tok.encode(s, add_special_tokens=False) == [t]
                             for s in (w, " " + w) for t in free))
    params = greedy.clone(bad_words=[word])
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    assert params.bad_words_token_ids
    assert any(_contains(free, s) for s in params.bad_words_token_ids)
    assert not any(_contains(out, s) for s in params.bad_words_token_ids), (word, out)
    # a two-token word: its second token is banned right after its first only
    pair = next(free[i:i + 2] for i in range(len(free) - 1)
                if tok.encode(tok.decode(free[i:i + 2]), add_special_tokens=False) == free[i:i + 2])
    params = greedy.clone(bad_words=[tok.decode(pair)])
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    assert pair in params.bad_words_token_ids and _contains(free, pair)
    assert not _contains(out, pair)
    assert out[:free.index(pair[0]) + 1] == free[:free.index(pair[0]) + 1]  # the first token stays


SCHEMA = {"type": "object", "properties": {"abc": {"type": "string", "maxLength": 3}},
          "required": ["abc"], "additionalProperties": False}


def test_bans_against_the_grammar_still_give_valid_output(llm):
    tok = llm.get_tokenizer()
    so = StructuredOutputsParams(json=SCHEMA, whitespace="compact")
    opens = {i: -100.0 for t, i in tok.get_vocab().items() if tok.decode([i]).lstrip().startswith("{")}
    for kw in (dict(logit_bias=opens), dict(allowed_token_ids=[300, 301])):
        for temp in (0, 1.0):
            outs = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=temp, seed=1, n=2,
                                                       structured_outputs=so, **kw),
                                use_tqdm=False)[0].outputs
            for c in outs:
                assert c.finish_reason in ("stop", "length"), c.finish_reason
                if c.finish_reason == "stop":
                    jsonschema.validate(json.loads(c.text), SCHEMA)
    choice = llm.generate(PROMPT, SamplingParams(
        max_tokens=8, temperature=0, allowed_token_ids=[300],
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"])), use_tqdm=False)
    assert choice[0].outputs[0].text in ("yes", "no")
    assert choice[0].outputs[0].finish_reason == "stop"


def test_restricted_requests_sample_every_token(llm):
    """No jump-forward under bans: with only one-character tokens allowed, the keys the
    grammar forces are written one character at a time too. (xgrammar's mask allows
    any tokenization of forced text; llguidance's allows only the canonical one, so
    under it the grammar wins there, as in the test above.)"""
    tok = llm.get_tokenizer()
    chars = {tok.convert_tokens_to_ids(c) for c in '{}":abcxyz'}
    chars.discard(tok.unk_token_id)
    allowed = sorted(chars | {tok.eos_token_id})
    so = StructuredOutputsParams(json=SCHEMA, whitespace="compact", backend="xgrammar")
    out = llm.generate(PROMPT, SamplingParams(max_tokens=30, temperature=0, allowed_token_ids=allowed,
                                              structured_outputs=so), use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed), [tok.decode([t]) for t in out.token_ids]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert out.text.startswith('{"abc":"')
