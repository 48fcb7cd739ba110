"""Beam search (vLLM's `LLM.beam_search` and `use_beam_search`), driven from the
front end as vLLM drives it: each round, every live beam is one request for one
token with the top 2 x width logprobs; each beam's candidates (its tokens plus one
of those) are ranked by score and the best `width` live on; a candidate ending in
the end-of-sequence token is complete. After max_tokens rounds the best `width`
of the complete and live beams are the result. Score: the cumulative logprob
divided by the sequence's length (prompt included, the end token not) to the
power `length_penalty` (vLLM's `get_beam_search_score`).

The rounds reuse the prompt's and each beam's cached blocks through prefix
caching, so a round costs about one decode step per beam. Sampling fields other
than these (stop strings, penalties, constraints) do not apply to a beam search.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from formwork.schemas.sampling import MAX_BEAM_WIDTH, check_beam_width  # noqa: F401


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's and the generated ones (as vLLM's)."""
    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)   # candidates per step
    cum_logprob: float = 0.0
    text: str | None = None          # the generated text
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(seq: BeamSearchSequence, eos_token_id: int | None,
               length_penalty: float) -> float:
    n = len(seq.tokens) - (1 if seq.tokens and seq.tokens[-1] == eos_token_id else 0)
    return seq.cum_logprob / (max(n, 1) ** length_penalty)


class BeamSearch:
    """One prompt's search; `live()` lists the beams to extend this round, `advance`
    takes their candidates (token id -> logprob), `result` ranks the end."""

    def __init__(self, prompt_ids: list[int], width: int, max_tokens: int,
                 eos_token_id: int | None, *, ignore_eos: bool = False,
                 length_penalty: float = 1.0, max_model_len: int | None = None) -> None:
        self.width, self.max_tokens = width, max_tokens
        self.eos, self.ignore_eos, self.length_penalty = eos_token_id, ignore_eos, length_penalty
        self.max_model_len = max_model_len
        n = len(prompt_ids)
        self.beams = [BeamSearchSequence(list(prompt_ids), num_prompt_tokens=n)]
        self.completed: list[BeamSearchSequence] = []
        self.rounds = 0

    def _score(self, seq: BeamSearchSequence) -> float:
        return beam_score(seq, self.eos, self.length_penalty)

    def live(self) -> list[BeamSearchSequence]:
        return self.beams if self.rounds < self.max_tokens else []

    def advance(self, candidates: list[dict[int, float]]) -> None:
        assert len(candidates) == len(self.beams), (len(candidates), len(self.beams))
        grown: list[BeamSearchSequence] = []
        for beam, top in zip(self.beams, candidates):
            for token, logprob in top.items():
                seq = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top],
                                         beam.cum_logprob + logprob,
                                         num_prompt_tokens=beam.num_prompt_tokens)
                if token == self.eos and not self.ignore_eos:
                    seq.finish_reason, seq.stop_reason = "stop", None
                    self.completed.append(seq)
                else:
                    grown.append(seq)
        grown.sort(key=self._score, reverse=True)
        self.beams = grown[:self.width]
        self.rounds += 1
        if self.max_model_len is not None:        # a beam at the context's end stops there
            full = [b for b in self.beams if len(b.tokens) >= self.max_model_len]
            for b in full:
                b.finish_reason = "length"
            self.completed += full
            self.beams = [b for b in self.beams if len(b.tokens) < self.max_model_len]

    def result(self, decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        for b in self.beams:
            b.finish_reason = "length"
        best = sorted(self.completed + self.beams, key=self._score, reverse=True)[:self.width]
        for b in best:
            b.text = decode(b.generated)
        return BeamSearchOutput(best)


async def serve_beam_search(state, request_id: str, prompt_ids: list[int], width: int,
                            max_tokens: int, *, ignore_eos: bool = False,
                            temperature: float = 0.0,
                            length_penalty: float = 1.0) -> BeamSearchOutput:
    """The server's beam search (`use_beam_search`): each round's one-token requests
    go to the engine concurrently (one batch), as any other requests."""
    import asyncio
    import itertools

    from formwork.gateway.metrics import RequestTimer
    from formwork.gateway.serving import generate_final
    from formwork.schemas.sampling import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=temperature, logprobs=2 * width,
                         ignore_eos=True)
    search = BeamSearch(prompt_ids, width, max_tokens, state.tokenizer.eos_token_id,
                        ignore_eos=ignore_eos, length_penalty=length_penalty,
                        max_model_len=state.max_model_len)
    ids = itertools.count()

    async def candidates(tokens: list[int]) -> dict[int, float]:
        ro = await generate_final(state, f"{request_id}-beam{next(ids)}", None, tokens, one,
                                  RequestTimer())
        lp = ro.outputs[0].logprobs[0]
        return {a.token_id: a.logprob for a in lp.top} | {lp.chosen.token_id: lp.chosen.logprob}

    while live := search.live():
        search.advance(list(await asyncio.gather(*(candidates(b.tokens) for b in live))))
    return search.result(lambda t: state.tokenizer.decode(t, skip_special_tokens=True))


def check_beam_request(req, source: str | None, *, chat: bool) -> None:
    """400 naming the field a beam search cannot serve beside it (as vLLM's server:
    no streaming; here also no constraint, logprobs, echo or best_of)."""
    import math

    from formwork.gateway.errors import bad_request
    from formwork.schemas.errors import ParamError

    refused = [("stream", req.stream),
               (source or "", source is not None),
               ("logprobs", bool(req.logprobs) if chat else req.logprobs is not None)]
    if not chat:
        refused += [("echo", req.echo), ("best_of", req.best_of not in (None, req.n))]
    for name, on in refused:
        if on:
            raise bad_request(f"{name}: cannot be used with use_beam_search", param=name)
    if not math.isfinite(req.length_penalty):
        raise bad_request(f"length_penalty: must be a finite number, got {req.length_penalty}",
                          param="length_penalty")
    try:
        check_beam_width(req.n, "n")
    except ParamError as e:
        raise bad_request(str(e), param="n") from None
