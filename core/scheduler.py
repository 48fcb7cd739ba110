"""Iteration-level continuous batching over a paged KV cache.

Owner of request status, queues and token counts. Step contract:
    plan = schedule()                      # decides; commits no progress
    ...the runner executes plan...
    outs = update_from_output(plan, out)   # the only place progress is committed
Finishes decided inside schedule() (grammar compile failure, KV capacity) are
returned by take_finished_outputs() (update_from_output/fail_step also drain
them). An empty plan need not be executed nor updated: finished_req_ids are
only handed out with a non-empty plan. The runner must drop `finished_req_ids`
before adding `new_reqs` (a preempted or re-used id can appear in both).
"""
from __future__ import annotations

from collections import deque

from formwork.core import policy
from formwork.core.interfaces import StructuredOutputManagerProtocol
from formwork.core.kv_cache import KVCacheManager
from formwork.core.output_buffer import OutputBuffer
from formwork.core.plan import PlanBuilder, resend_plan
from formwork.core.prompt_logprobs import scores_prompt
from formwork.core.request import Request, RequestStatus
from formwork.core.token_commit import commit_sampled
from formwork.schemas.engine import EngineCoreOutput
from formwork.schemas.scheduler import ModelRunnerOutput, SchedulerOutput

_WAITING = (RequestStatus.WAITING, RequestStatus.WAITING_FOR_GRAMMAR, RequestStatus.PREEMPTED)


class Scheduler:
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 enable_chunked_prefill: bool, kv_cache_manager: KVCacheManager,
                 structured_output_manager: StructuredOutputManagerProtocol | None = None,
                 long_prefill_token_threshold: int = 0, scheduling_policy: str = "fcfs") -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.kv = kv_cache_manager
        self.som = structured_output_manager
        self.long_prefill_token_threshold = long_prefill_token_threshold if enable_chunked_prefill else 0
        # "priority": the waiting queue is kept in (priority, arrival) order and the
        # preemption victim is the highest (priority, arrival); "fcfs": arrival order
        self.by_priority = scheduling_policy == "priority"
        self.requests: dict[str, Request] = {}     # unfinished only
        # WAITING / WAITING_FOR_GRAMMAR / PREEMPTED: FCFS, or (priority, arrival) order
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []           # RUNNING, admission order
        self.num_preemptions = 0
        self._in_runner: set[str] = set()          # ids whose state the runner holds
        self._finished_ids: set[str] = set()       # reported in the next plan
        self._pending_outputs: list[EngineCoreOutput] = []     # finishes decided in schedule()
        self._outputs = OutputBuffer()

    # ---- intake --------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue req; ValueError (nothing queued) when it can never run. The prompt
        was checked at the engine's door (core/prompt_check.py): asserted here."""
        n = req.num_prompt_tokens
        assert 0 < n < self.max_model_len, f"prompt of {n} tokens, max_model_len {self.max_model_len}"
        if error := policy.admission_error(
                n, blocks_needed=self.kv.num_blocks_for(n + 1), num_blocks=self.kv.num_blocks,
                chunked=self.enable_chunked_prefill,
                max_num_batched_tokens=self.max_num_batched_tokens):
            raise ValueError(error)
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.use_structured_output:
            if self.som is None:
                raise ValueError("structured outputs requested but no structured output manager")
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.som.submit(req.request_id, req.sampling_params.structured_outputs,
                            budget=policy.token_budget(n, req.sampling_params.max_tokens,
                                                       self.max_model_len))
        else:
            req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        if self.by_priority:
            self._insert_by_priority(req)
        else:
            self.waiting.append(req)

    @staticmethod
    def _rank(req: Request) -> tuple[int, float]:
        return req.sampling_params.priority, req.arrival_time

    def _highest_rank(self, reqs: list[Request]) -> Request:
        """The priority policy's preemption victim: highest (priority, arrival), ties
        -> the last position (as policy.pick_victim)."""
        return max(reversed(reqs), key=self._rank)

    def _insert_by_priority(self, req: Request) -> None:
        """Into `waiting` after every request of a lower or equal rank (a preempted one
        keeps its arrival time, so it comes back before later arrivals of its priority)."""
        rank = self._rank(req)
        i = len(self.waiting)
        while i > 0 and self._rank(self.waiting[i - 1]) > rank:
            i -= 1
        self.waiting.insert(i, req)

    # ---- planning ------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one step. Mutates queues/status/blocks, never num_computed_tokens
        (except the rollback to 0 of a preempted request)."""
        plan = PlanBuilder(self.max_num_batched_tokens)
        if self.by_priority:
            self._seat_for_priority()
        preemptions_before = self.num_preemptions
        self._schedule_running(plan)
        if self.num_preemptions == preemptions_before:
            self._schedule_waiting(plan)
        if plan.out.total_num_scheduled_tokens > 0:   # an empty plan may never reach the runner
            plan.out.finished_req_ids, self._finished_ids = self._finished_ids, set()
        return plan.out

    def take_finished_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests finished inside schedule(); each returned once."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def _schedule_running(self, plan: PlanBuilder) -> None:
        i = 0
        while i < len(self.running) and plan.budget > 0:
            req = self.running[i]
            c = req.num_computed_tokens
            n = policy.fit_chunk(req.num_tokens - c, plan.budget, room=self.max_model_len - c,
                                 allow_partial=True,
                                 long_prefill_threshold=self.long_prefill_token_threshold)
            if n == 0:
                i += 1
                continue
            new_ids = self._allocate_or_preempt(i, n)
            if new_ids is None:            # req itself was preempted or finished
                continue
            plan.add(req, n, c, new_block_ids=new_ids)
            i += 1

    def _allocate_or_preempt(self, i: int, n: int) -> list[int] | None:
        """allocate_slots for running[i], preempting later arrivals among running[i:]."""
        req = self.running[i]
        while (new_ids := self.kv.allocate_slots(req, n)) is None:
            if len(self.running) == 1:     # cannot fit even alone: KV capacity is its length limit
                self._pending_outputs.append(self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED))
                return None
            cands = self.running[i:]
            victim = (self._highest_rank(cands) if self.by_priority
                      else cands[policy.pick_victim([r.arrival_time for r in cands])])
            self._preempt(victim)
            if victim is req:
                return None
        return new_ids

    def _seat_for_priority(self) -> None:
        """Priority policy with every seat taken: the first waiting request whose grammar
        is not compiling takes the seat of the running request of the highest priority
        value if its own value is lower (one per step). The one preempted recomputes
        later; its full blocks stay in the prefix cache. Without it an urgent request
        waits until a whole batch of bulk ones finishes."""
        if len(self.running) < self.max_num_seqs or not self.running:
            return
        head = next((r for r in self.waiting if r.status != RequestStatus.WAITING_FOR_GRAMMAR), None)
        if head is None:
            return
        victim = self._highest_rank(self.running)
        if head.sampling_params.priority < victim.sampling_params.priority:
            self._preempt(victim)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0        # recompute: K/V are dropped
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            self._insert_by_priority(req)
        else:
            self.waiting.appendleft(req)
        self._drop_from_runner(req.request_id)

    def _schedule_waiting(self, plan: PlanBuilder) -> None:
        skipped: list[Request] = []        # grammar still compiling: keep place, don't block
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.status == RequestStatus.WAITING_FOR_GRAMMAR and not self._grammar_ready(req):
                if not req.is_finished:
                    skipped.append(self.waiting.popleft())
                continue
            # prompt logprobs need every prompt position computed: no prefix-cache hit (as
            # vLLM); the blocks it fills are still cached for others
            computed_ids, num_hit = (([], 0) if scores_prompt(req)
                                     else self.kv.get_computed_blocks(req))
            n = policy.fit_chunk(req.num_tokens - num_hit, plan.budget,
                                 room=self.max_model_len - num_hit,
                                 # a resumed request may be longer than the budget
                                 allow_partial=(self.enable_chunked_prefill
                                                or req.status == RequestStatus.PREEMPTED),
                                 long_prefill_threshold=self.long_prefill_token_threshold)
            if n == 0 or (new_ids := self.kv.allocate_slots(req, n, computed_ids)) is None:
                break                      # nobody overtakes the head (FCFS or priority order)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            self._in_runner.add(req.request_id)
            plan.add(req, n, num_hit, new_block_ids=new_ids,
                     all_block_ids=self.kv.get_block_ids(req.request_id))
        self.waiting.extendleft(reversed(skipped))

    def _grammar_ready(self, req: Request) -> bool:
        """Moves a compiled request to WAITING; finishes a failed one (req leaves the queue)."""
        status = self.som.status(req.request_id)
        if status == "ready":
            req.status = RequestStatus.WAITING
            return True
        if status == "failed":
            self._pending_outputs.append(self._finish(
                req, RequestStatus.FINISHED_ERROR, error=self.som.error(req.request_id)))
        return False

    # ---- committing ----------------------------------------------------
    def update_from_output(self, sched_out: SchedulerOutput,
                           runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        assert len(runner_out.req_ids) == len(runner_out.sampled_token_ids)
        assert set(runner_out.req_ids) == set(sched_out.sampling_req_ids), \
            f"runner sampled {runner_out.req_ids}, plan expected {sched_out.sampling_req_ids}"
        outputs = self.take_finished_outputs()
        base = {r.req_id: r.num_computed_tokens for r in sched_out.new_reqs}
        base.update((r.req_id, r.num_computed_tokens) for r in sched_out.cached_reqs)
        lps = runner_out.logprobs or [None] * len(runner_out.req_ids)
        plps = runner_out.prompt_logprobs or {}
        sampled = {rid: (tok, lp) for rid, tok, lp in
                   zip(runner_out.req_ids, runner_out.sampled_token_ids, lps)}
        for rid, n in sched_out.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue                   # finished or aborted after schedule()
            req.num_computed_tokens = base[rid] + n
            self.kv.cache_full_blocks(req, req.num_computed_tokens)
            if scores_prompt(req):
                self._outputs.add_prompt_logprobs(req, plps.get(rid))
            status = None
            if rid in sampled:             # max_tokens 0 (scoring only): the token is dropped
                status = (RequestStatus.FINISHED_LENGTH_CAPPED if req.sampling_params.max_tokens == 0
                          else commit_sampled(req, *sampled[rid], outputs=self._outputs,
                                              som=self.som, max_model_len=self.max_model_len))
            if status is not None:
                outputs.append(self._finish(req, status))
            elif req.pending_output_ids:
                outputs.append(self._outputs.emit(req))
        return outputs

    # ---- finishing -----------------------------------------------------
    def _finish(self, req: Request, status: RequestStatus, error: str | None = None) -> EngineCoreOutput:
        """The one exit: leave the queues, free blocks once, drop the matcher."""
        assert status.is_finished and not req.is_finished, (req.request_id, req.status, status)
        rid = req.request_id
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        if self.kv.holds(rid):
            self.kv.free(req)
        if req.use_structured_output and self.som is not None:
            self.som.remove(rid)
        req.status = status
        req.error = error or req.error
        del self.requests[rid]
        self._drop_from_runner(rid)
        out = self._outputs.emit(req)    # carries prompt logprobs completed this step
        self._outputs.drop(rid)
        return out

    def _drop_from_runner(self, rid: str) -> None:
        if rid in self._in_runner:
            self._in_runner.discard(rid)
            self._finished_ids.add(rid)

    def finish_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED
                        ) -> list[EngineCoreOutput]:
        """Abort (or otherwise finish) by id; unknown or finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        return [self._finish(self.requests[rid], status)
                for rid in dict.fromkeys(request_ids) if rid in self.requests]

    def fail_step(self, sched_out: SchedulerOutput, message: str) -> list[EngineCoreOutput]:
        """A failed model step: commit nothing, finish its requests with an error."""
        outputs = self.take_finished_outputs()
        for rid in sched_out.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                outputs.append(self._finish(req, RequestStatus.FINISHED_ERROR, error=message))
        return outputs

    def sub_plan(self, plan: SchedulerOutput, req_ids: list[str]) -> SchedulerOutput:
        """`plan` restricted to the still-running `req_ids`, each re-sent in full
        (core/plan.resend_plan). Mutates nothing: progress is still committed only by
        update_from_output(sub_plan, ...)."""
        keep = {rid: r for rid in req_ids
                if (r := self.requests.get(rid)) is not None and r.status == RequestStatus.RUNNING}
        return resend_plan(plan, keep, self.kv.get_block_ids)

    # ---- queries -------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting_for_grammar(self) -> int:
        return sum(r.status == RequestStatus.WAITING_FOR_GRAMMAR for r in self.waiting)

    @property
    def num_waiting(self) -> int:
        """WAITING + PREEMPTED (grammar-compiling ones are counted apart)."""
        return len(self.waiting) - self.num_waiting_for_grammar

    def check_invariants(self) -> None:
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        assert len(set(running_ids)) == len(running_ids), f"duplicate in running {running_ids}"
        assert len(set(waiting_ids)) == len(waiting_ids), f"duplicate in waiting {waiting_ids}"
        assert not set(running_ids) & set(waiting_ids), "request both running and waiting"
        assert set(running_ids) | set(waiting_ids) == set(self.requests), "queues != unfinished requests"
        if self.by_priority:
            ranks = [self._rank(r) for r in self.waiting]
            assert ranks == sorted(ranks), f"waiting out of priority order: {ranks}"
        assert len(self.running) <= self.max_num_seqs, f"{len(self.running)} running > max_num_seqs"
        for req in self.running:
            rid = req.request_id
            assert self.requests[rid] is req and req.status == RequestStatus.RUNNING, (rid, req.status)
            assert 0 <= req.num_computed_tokens <= req.num_tokens <= self.max_model_len, \
                f"{rid}: computed {req.num_computed_tokens}, tokens {req.num_tokens}"
            assert len(self.kv.get_block_ids(rid)) * self.kv.block_size >= req.num_computed_tokens, \
                f"{rid}: fewer block slots than computed tokens"
        for req in self.waiting:
            assert self.requests[req.request_id] is req and req.status in _WAITING, \
                (req.request_id, req.status)
            assert req.num_computed_tokens == 0, f"{req.request_id}: waiting with computed tokens"
        assert self.kv.req_ids() == set(running_ids), \
            f"blocks held by {self.kv.req_ids()}, running {set(running_ids)}"
        assert self._in_runner == set(running_ids), "runner state out of sync with running"
        self.kv.check_invariants()
