"""What one sampled token does to its request (called by the Scheduler, the
request's owner, from update_from_output): append it, advance the grammar,
check the stop conditions, append the grammar's forced continuation."""
from __future__ import annotations

from formwork.core import policy
from formwork.core.interfaces import StructuredOutputManagerProtocol
from formwork.core.output_buffer import OutputBuffer, RawLogprobs
from formwork.core.request import Request, RequestStatus

_FORCED: RawLogprobs = (0.0, [], 1)     # a token the budget (or the grammar) forced: p = 1 under it


def commit_sampled(req: Request, token_id: int, lp: RawLogprobs | None, *,
                   outputs: OutputBuffer, som: StructuredOutputManagerProtocol | None,
                   max_model_len: int) -> RequestStatus | None:
    """Append a sampled token (+ grammar jump-forward); the finish status if it ends
    req (req.error / req.stop_reason set to say why)."""
    rid = req.request_id
    if req.use_structured_output and not req.sampling_params.restricts_tokens:
        closer = som.budget_guard(rid, token_id)
        if closer is not None:     # the pick left no room to close: the closing path's token
            token_id, lp = closer, _FORCED
    outputs.append(req, token_id, lp)
    if req.use_structured_output:
        if not som.accept_tokens(rid, [token_id]):
            req.error = som.error(rid) or "grammar rejected token"
            return RequestStatus.FINISHED_ERROR
        if som.is_terminated(rid):    # closed for its budget: max_tokens ended it
            return (RequestStatus.FINISHED_LENGTH_CAPPED if som.budget_closed(rid)
                    else RequestStatus.FINISHED_STOPPED)
    status = _stop_status(req, token_id, max_model_len)
    if status is not None or not req.use_structured_output:
        return status
    if req.sampling_params.restricts_tokens:    # its tokens are sampled under its bans
        return None
    if req.sampling_params.logprobs is not None:
        # Logprobs were asked for: every token is sampled by the model, so each one
        # carries the model's numbers (raw mode: its own distribution, as vLLM, which
        # has no jump-forward), not the p = 1 of a continuation the grammar forced.
        return None
    for forced in som.jump_forward_tokens(rid):
        outputs.append(req, forced, _FORCED)   # forced by the grammar (no logprobs asked)
        if (status := _stop_status(req, forced, max_model_len)) is not None:
            return status
    return None


def _stop_status(req: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    status, reason = policy.check_stop(
        token_id, num_output_tokens=req.num_output_tokens, num_tokens=req.num_tokens,
        eos_token_id=req.eos_token_id, params=req.sampling_params, max_model_len=max_model_len)
    if status is not None:
        req.stop_reason = reason
    return status
