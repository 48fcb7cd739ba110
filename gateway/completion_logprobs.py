"""Logprobs in the legacy completions shape (tokens, token_logprobs,
top_logprobs, text_offset) and vLLM's `prompt_logprobs` field, as both
/v1/completions and /v1/chat/completions return them."""
from __future__ import annotations

from formwork.gateway.output_processor import PromptLogprobsList
from formwork.gateway.serving import TokenText
from formwork.schemas.engine import TokenLogprobs
from formwork.schemas.openai import CompletionLogprobs, PromptLogprob


def _clamp(logprob: float) -> float:
    return max(logprob, -9999.0)          # -inf is not JSON (as vLLM)


def completion_logprobs(lps: list[TokenLogprobs] | None, text: TokenText, offset: int,
                        out: CompletionLogprobs | None = None) -> CompletionLogprobs | None:
    """Appends the generated tokens' logprobs (text offsets from `offset`) to `out`."""
    if lps is None:
        return out
    out = out if out is not None else CompletionLogprobs()
    for lp in lps:
        out.tokens.append(text.label(lp.chosen.token_id))
        out.token_logprobs.append(lp.chosen.logprob)
        out.top_logprobs.append({text.label(a.token_id): a.logprob for a in lp.top} or None)
        out.text_offset.append(offset)
        offset += len(text(lp.chosen.token_id))
    return out


def echo_logprobs(ids: list[int], plps: PromptLogprobsList | None,
                  text: TokenText) -> CompletionLogprobs:
    """The prompt tokens as legacy completion logprobs: the first one (and any position
    not scored) has null logprob; top_logprobs holds the prompt token and the top-k."""
    out, offset = CompletionLogprobs(), 0
    for tid, d in zip(ids, plps or [None] * len(ids)):
        out.tokens.append(text.label(tid))
        out.text_offset.append(offset)
        offset += len(text(tid))
        out.token_logprobs.append(_clamp(d[tid].logprob) if d else None)
        out.top_logprobs.append({text.label(t): _clamp(lp.logprob) for t, lp in d.items()}
                                if d else None)
    return out


def prompt_logprobs_field(plps: PromptLogprobsList | None):
    """The engine's prompt logprobs as vLLM's response field (token id -> entry)."""
    if plps is None:
        return None
    return [None if d is None else
            {t: PromptLogprob(logprob=_clamp(lp.logprob), rank=lp.rank,
                              decoded_token=lp.decoded_token) for t, lp in d.items()}
            for d in plps]
