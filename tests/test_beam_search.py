"""Beam search (vLLM's `LLM.beam_search` / `use_beam_search`): the search on a toy
distribution where greedy decoding misses the best sequence, end tokens, length
penalty and the context's end; through the offline `LLM` on the tiny model
against a beam search over HF transformers' logprobs, each sequence's cumulative
logprob checked against HF's."""
from __future__ import annotations

import math

import pytest

from formwork import LLM, BeamSearchParams
from formwork.gateway.beam_search import BeamSearch, beam_score
from formwork.schemas.errors import ParamError
from test_prompt_logprobs import _ids, hf_logprobs, tiny_hf  # noqa: F401 (fixture)

EOS = 0
LN = math.log


def _run(search: BeamSearch, model) -> list:
    while live := search.live():
        search.advance([model(b.tokens) for b in live])
    return search.result(lambda ids: " ".join(map(str, ids))).sequences


def toy(tokens: list[int]) -> dict[int, float]:
    """After the prompt [9]: 1 (0.6) or 2 (0.4); after 1 three tokens of 0.2/0.2/0.6
    ... spread; after 2 one token of 0.9: greedy takes 1, the best pair starts with 2."""
    last = tokens[-1]
    if last == 9:
        return {1: LN(0.6), 2: LN(0.4)}
    if last == 1:
        return {3: LN(0.35), 4: LN(0.35), 5: LN(0.3)}
    if last == 2:
        return {6: LN(0.9), 7: LN(0.1)}
    return {EOS: LN(0.5), 8: LN(0.5)}


def test_beam_search_finds_what_greedy_misses():
    greedy = [9]
    for _ in range(2):
        greedy.append(max(toy(greedy).items(), key=lambda kv: kv[1])[0])
    assert greedy == [9, 1, 3]                                       # 0.6 * 0.35 = 0.21
    best = _run(BeamSearch([9], 2, 2, EOS), toy)
    assert best[0].generated == [2, 6]                               # 0.4 * 0.9 = 0.36
    assert best[0].cum_logprob == pytest.approx(LN(0.36))
    assert len(best) == 2 and best[1].generated == [1, 3]
    assert all(s.finish_reason == "length" for s in best)
    assert _run(BeamSearch([9], 1, 2, EOS), toy)[0].generated == [9, 1, 3][1:]   # width 1: greedy


def test_end_token_completes_a_beam_and_length_penalty_ranks():
    seqs = _run(BeamSearch([9], 2, 4, EOS), toy)
    done = [s for s in seqs if s.finish_reason == "stop"]
    assert done and all(s.tokens[-1] == EOS for s in done)
    # the score divides by length ** penalty (prompt included, the end token not)
    for s in seqs:
        n = len(s.tokens) - (s.tokens[-1] == EOS)
        assert beam_score(s, EOS, 1.0) == pytest.approx(s.cum_logprob / n)
    assert [beam_score(s, EOS, 1.0) for s in seqs] == sorted(
        (beam_score(s, EOS, 1.0) for s in seqs), reverse=True)
    # no length penalty favours short sequences: the best is a complete one
    short = _run(BeamSearch([9], 2, 4, EOS, length_penalty=0.0), toy)
    assert short[0].finish_reason == "stop" and len(short[0].generated) == 3
    long_ = _run(BeamSearch([9], 2, 4, EOS, ignore_eos=True), toy)
    assert all(EOS not in s.generated[:-1] and s.finish_reason == "length" for s in long_)


def test_a_beam_stops_at_the_context_end():
    seqs = _run(BeamSearch([9], 2, 10, EOS, ignore_eos=True, max_model_len=4), toy)
    assert all(len(s.tokens) == 4 and s.finish_reason == "length" for s in seqs)


@pytest.mark.parametrize("kw,param", [(dict(beam_width=0), "beam_width"),
                                      (dict(beam_width=11), "beam_width"),
                                      (dict(max_tokens=0), "max_tokens"),
                                      (dict(length_penalty=float("nan")), "length_penalty")])
def test_bad_params_name_the_field(kw, param):
    with pytest.raises(ParamError) as e:
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kw})
    assert e.value.param == param


def _reference(model, prompt: list[int], width: int, max_tokens: int, eos: int) -> list:
    """The same search over HF transformers' logprobs (top 2 x width per beam)."""
    def top(tokens):
        lp = hf_logprobs(model, tokens)[-1]
        vals, idx = lp.topk(2 * width)
        return dict(zip(idx.tolist(), vals.tolist()))
    return _run(BeamSearch(prompt, width, max_tokens, eos), top)


def test_llm_beam_search_matches_a_search_over_hf_logprobs(tiny_model_dir, tiny_hf):
    llm = LLM(str(tiny_model_dir), engine_process=False, dtype="float32", num_kv_blocks=128,
              block_size=8)
    try:
        prompts = [_ids(6, 1), _ids(11, 2)]
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                               BeamSearchParams(beam_width=3, max_tokens=5))
        eos = llm.get_tokenizer().eos_token_id
        tok = llm.get_tokenizer()
        for prompt, out in zip(prompts, outs):
            ref = _reference(tiny_hf, prompt, 3, 5, eos)
            assert [s.tokens for s in out.sequences] == [s.tokens for s in ref]
            for s in out.sequences:
                assert s.tokens[:len(prompt)] == prompt and len(s.generated) == 5
                lp = hf_logprobs(tiny_hf, s.tokens)
                own = sum(float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(s.generated))
                assert s.cum_logprob == pytest.approx(own, abs=2e-3)
                assert s.text == tok.decode(s.generated, skip_special_tokens=True)
        # a text prompt; width 1 is greedy decoding
        greedy = llm.generate("Hello", __import__("formwork").SamplingParams(
            temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0].outputs[0]
        one = llm.beam_search(["Hello"], BeamSearchParams(beam_width=1, max_tokens=4,
                                                         ignore_eos=True))[0].sequences
        assert len(one) == 1 and one[0].generated == greedy.token_ids
        with pytest.raises(ValueError, match="lora_request"):
            llm.beam_search(["Hello"], BeamSearchParams(beam_width=1, max_tokens=1),
                            lora_request=object())
    finally:
        llm.shutdown()
