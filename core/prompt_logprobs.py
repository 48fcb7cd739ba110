"""Prompt logprobs collected across a request's prefill chunks (scheduler-owned).

The runner scores the prompt positions each chunk computed and returns
`(first position, entries)`; once the whole prompt is computed, the list goes
out with the request's next output. A prefill recomputed after preemption
restarts at position 0 and overwrites what was collected.
"""
from __future__ import annotations

from formwork.core.request import Request
from formwork.schemas.engine import PromptLogprobs


def scores_prompt(req: Request) -> bool:
    """Prompt logprobs asked and not yet sent (none once outputs exist)."""
    return req.sampling_params.prompt_logprobs is not None and req.num_output_tokens == 0


class PromptLogprobsCollector:
    def __init__(self) -> None:
        self._partial: dict[str, list[PromptLogprobs]] = {}   # prefill under way
        self._ready: dict[str, list[PromptLogprobs]] = {}     # for the next output

    def add(self, req: Request, chunk: tuple[int, list[PromptLogprobs]] | None) -> None:
        rid = req.request_id
        acc = self._partial.setdefault(rid, [])
        if chunk is not None:
            start, entries = chunk
            del acc[start:]
            assert len(acc) == start, f"{rid}: prompt logprobs from {start}, have {len(acc)}"
            acc.extend(entries)
        if req.num_computed_tokens >= req.num_prompt_tokens:
            assert len(acc) == req.num_prompt_tokens - 1, (rid, len(acc), req.num_prompt_tokens)
            self._ready[rid] = self._partial.pop(rid)

    def take(self, rid: str) -> list[PromptLogprobs] | None:
        """The complete list, once; None before the prompt is computed."""
        return self._ready.pop(rid, None)

    def drop(self, rid: str) -> None:
        self._partial.pop(rid, None)
        self._ready.pop(rid, None)
