"""What the scheduler hands the worker each step, and what comes back.

In-process only (core -> gpu). Block ids and token counts, never K/V values.
The scheduler sends a request's full data once (NewRequestData) and only diffs
afterwards (CachedRequestData); the ModelRunner keeps persistent state.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from formwork.schemas.engine import PromptLogprobs
from formwork.schemas.sampling import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int          # tokens already in the KV cache (prefix hit)
    output_token_ids: list[int] = field(default_factory=list)  # non-empty when resumed after preemption
    eos_token_id: int | None = None   # masked (with stop_token_ids) until min_tokens are out


@dataclass(slots=True)
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]          # blocks appended since last step
    num_computed_tokens: int
    new_token_ids: list[int]          # exactly the tokens scheduled this step (positions num_computed_tokens..)


@dataclass(slots=True)
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]   # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]             # runner drops their state
    # req ids whose next token is sampled this step (prefill completes or decode), in
    # batch order; partial prefill chunks produce no token.
    sampling_req_ids: list[str] = field(default_factory=list)
    structured_req_ids: list[str] = field(default_factory=list)  # subset needing a bitmask row

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]                     # == SchedulerOutput.sampling_req_ids
    sampled_token_ids: list[int]
    # per sampled req: (chosen logprob, [(token_id, logprob), ...], chosen rank) or None
    logprobs: list[tuple[float, list[tuple[int, float]], int] | None] | None = None
    # req_id -> (p, entries): entries[j] scores prompt token p + 1 + j (computed at
    # position p + j this step); only requests with prompt_logprobs, any step of their prefill
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprobs]]] | None = None
