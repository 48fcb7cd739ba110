"""Scheduling policy as small pure functions (no state, no mutation).

The Scheduler composes them; tests check them with tables.
"""
from __future__ import annotations

from collections.abc import Sequence

from formwork.core.request import RequestStatus
from formwork.schemas.sampling import SamplingParams


def fit_chunk(num_remaining: int, token_budget: int, *, room: int, allow_partial: bool,
              long_prefill_threshold: int = 0) -> int:
    """Tokens to compute this step for a request with num_remaining uncomputed tokens.

    room: positions left before max_model_len. allow_partial: chunked prefill (a
    part may be scheduled); otherwise all or nothing. long_prefill_threshold > 0
    caps one step's chunk (only when partial chunks are allowed).
    Returns 0 when nothing can be scheduled.
    """
    n = min(num_remaining, room)
    if allow_partial and 0 < long_prefill_threshold < n:
        n = long_prefill_threshold
    if n <= token_budget:
        return max(n, 0)
    return max(token_budget, 0) if allow_partial else 0


def admission_error(num_prompt_tokens: int, *, blocks_needed: int, num_blocks: int,
                    chunked: bool, max_num_batched_tokens: int) -> str | None:
    """Why a prompt can never be scheduled by this engine (None: it can).

    blocks_needed: KV blocks for the prompt plus one generated token. Without
    chunked prefill the whole prompt must fit one step's token budget.
    """
    if blocks_needed > num_blocks:
        return (f"prompt needs {blocks_needed} KV blocks, the cache has {num_blocks}: "
                "shorten the prompt or enlarge the KV cache")
    if not chunked and num_prompt_tokens > max_num_batched_tokens:
        return (f"prompt has {num_prompt_tokens} tokens, more than max_num_batched_tokens "
                f"{max_num_batched_tokens} without chunked prefill")
    return None


def token_budget(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The most tokens a request may generate: max_tokens, and the context's room."""
    room = max_model_len - num_prompt_tokens
    return room if max_tokens is None else min(max_tokens, room)


def pick_victim(arrival_times: Sequence[float]) -> int:
    """Index of the request to preempt: latest arrival, ties -> the last position."""
    assert arrival_times, "no preemption candidate"
    return max(range(len(arrival_times)), key=lambda i: (arrival_times[i], i))


def samples_this_step(num_computed: int, num_scheduled: int, num_tokens: int) -> bool:
    """A step that computes up to the last known token yields a sampled token."""
    return num_computed + num_scheduled == num_tokens


def check_stop(token_id: int, *, num_output_tokens: int, num_tokens: int, eos_token_id: int | None,
               params: SamplingParams, max_model_len: int) -> tuple[RequestStatus | None, int | None]:
    """Whether appending token_id (already counted in the lengths) ends the request.

    Returns (finished status or None, stop_reason). Order: eos (unless ignore_eos),
    stop_token_ids (stop_reason = the id), max_tokens, max_model_len. eos and stop
    ids are ignored while num_output_tokens < min_tokens; length limits are not.
    """
    if num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and eos_token_id is not None and token_id == eos_token_id:
            return RequestStatus.FINISHED_STOPPED, None
        if params.stop_token_ids and token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED, None
    if num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED, None
    return None, None
