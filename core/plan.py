"""One step's SchedulerOutput, accumulated by the Scheduler; and the re-run of
part of a failed step's plan."""
from __future__ import annotations

from collections.abc import Callable

from formwork.core import policy
from formwork.core.request import Request
from formwork.schemas.scheduler import CachedRequestData, NewRequestData, SchedulerOutput


class PlanBuilder:
    """Accumulates one step's SchedulerOutput; does not mutate requests."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.out = SchedulerOutput(new_reqs=[], cached_reqs=[], num_scheduled_tokens={},
                                   total_num_scheduled_tokens=0, finished_req_ids=set())

    def add(self, req: Request, n: int, num_computed: int, *, new_block_ids: list[int],
            all_block_ids: list[int] | None = None) -> None:
        rid, out = req.request_id, self.out
        if all_block_ids is not None:
            out.new_reqs.append(NewRequestData(
                req_id=rid, prompt_token_ids=list(req.prompt_token_ids),
                sampling_params=req.sampling_params, block_ids=all_block_ids,
                num_computed_tokens=num_computed, output_token_ids=list(req.output_token_ids),
                eos_token_id=req.eos_token_id))
        else:
            out.cached_reqs.append(CachedRequestData(
                req_id=rid, new_block_ids=new_block_ids, num_computed_tokens=num_computed,
                new_token_ids=req.token_ids_slice(num_computed, num_computed + n)))
        out.num_scheduled_tokens[rid] = n
        out.total_num_scheduled_tokens += n
        self.budget -= n
        if policy.samples_this_step(num_computed, n, req.num_tokens):
            out.sampling_req_ids.append(rid)
            if req.use_structured_output:
                out.structured_req_ids.append(rid)


def resend_plan(plan: SchedulerOutput, keep: dict[str, Request],
                block_ids: Callable[[str], list[int]]) -> SchedulerOutput:
    """`plan` restricted to the requests in `keep` (still running), for re-running
    a failed step on part of its batch (EngineCore isolates the culprit). Same
    positions and token counts as `plan`; each request is re-sent in full
    (NewRequestData with all its blocks) and also listed in finished_req_ids, so
    the runner first drops the state the failed attempt left (it had applied the
    plan's diffs). Mutates nothing."""
    base = {r.req_id: r.num_computed_tokens for r in plan.new_reqs}
    base.update((r.req_id, r.num_computed_tokens) for r in plan.cached_reqs)
    sub = PlanBuilder(plan.total_num_scheduled_tokens)
    for rid, n in plan.num_scheduled_tokens.items():
        if rid in keep:
            sub.add(keep[rid], n, base[rid], new_block_ids=[], all_block_ids=block_ids(rid))
    # plan's other requests (a re-admitted id may be in both) keep their runner state
    sub.out.finished_req_ids = (plan.finished_req_ids - set(plan.num_scheduled_tokens)) | set(keep)
    return sub.out
