"""What each request produced since its last output message (scheduler-owned):
the tokens appended (on the Request), their logprobs, and the prompt logprobs
once the whole prompt is computed. `emit` turns them into one EngineCoreOutput
and clears them."""
from __future__ import annotations

from formwork.core.prompt_logprobs import PromptLogprobsCollector
from formwork.core.request import Request
from formwork.schemas.engine import EngineCoreOutput, Logprob, PromptLogprobs, TokenLogprobs

# (chosen token's logprob, [(token id, logprob) of the top ones], chosen token's 1-based
# rank) as the runner returns it
RawLogprobs = tuple[float, list[tuple[int, float]], int]


class OutputBuffer:
    def __init__(self) -> None:
        self._logprobs: dict[str, list[TokenLogprobs]] = {}
        self._prompt = PromptLogprobsCollector()

    def append(self, req: Request, token_id: int, lp: RawLogprobs | None) -> None:
        """Append a sampled (or grammar-forced) token to `req`'s output."""
        req.output_token_ids.append(token_id)
        req.pending_output_ids.append(token_id)
        if req.sampling_params.logprobs is not None and lp is not None:
            chosen, top, rank = lp
            self._logprobs.setdefault(req.request_id, []).append(TokenLogprobs(
                chosen=Logprob(token_id, chosen), top=[Logprob(t, v) for t, v in top], rank=rank))

    def add_prompt_logprobs(self, req: Request,
                            chunk: tuple[int, list[PromptLogprobs]] | None) -> None:
        """The prompt positions this step scored (core/prompt_logprobs.py)."""
        self._prompt.add(req, chunk)

    def emit(self, req: Request) -> EngineCoreOutput:
        """The output message for what was appended since the last one (clears it)."""
        out = EngineCoreOutput(
            request_id=req.request_id, new_token_ids=req.pending_output_ids,
            new_logprobs=self._logprobs.pop(req.request_id, None),
            prompt_logprobs=self._prompt.take(req.request_id),
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason if req.is_finished else None,
            num_cached_tokens=max(req.num_cached_tokens, 0), error=req.error)
        req.pending_output_ids = []
        return out

    def drop(self, rid: str) -> None:
        """Forget a finished request (after its last emit)."""
        self._logprobs.pop(rid, None)
        self._prompt.drop(rid)
