"""Request state inside the EngineCore. Owned by the Scheduler (status, token
counts); the KVCacheManager owns its blocks; the StructuredOutputManager owns
its grammar matcher."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from formwork.schemas.engine import EngineCoreRequest, FinishReason
from formwork.schemas.sampling import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: everything >= FINISHED_STOPPED is finished."""
    WAITING = 0
    WAITING_FOR_GRAMMAR = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0      # tokens whose K/V are in the cache
    num_cached_tokens: int = -1       # prefix-cache hit at first schedule (-1: not yet)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    # tokens appended since the last output message (sampled + jump-forward)
    pending_output_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_engine_request(cls, req: EngineCoreRequest) -> "Request":
        return cls(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            sampling_params=req.sampling_params,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            status=(RequestStatus.WAITING_FOR_GRAMMAR
                    if req.sampling_params.structured_outputs is not None
                    else RequestStatus.WAITING),
        )

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
