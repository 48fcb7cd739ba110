"""EngineCore: one thread owns all request state and runs the V1 step:

    schedule -> execute_model(plan, non_block=True) -> grammar bitmask (CPU,
    overlapping the forward) -> sample_tokens(bitmask) [-> check deferred picks,
    resample refused ones] -> apply aborts that arrived meanwhile ->
    update_from_output -> outputs

`abort_requests` may be called from any thread (it only queues); everything
else is called from the engine thread. A step that fails is re-run on halves
of its batch until the failing request(s) are found (`_isolate_failure`).
"""
from __future__ import annotations

import collections
import logging
import threading
import time

from formwork.core.kv_cache import KVCacheManager
from formwork.core.prompt_check import check_prompt
from formwork.core.request import Request, RequestStatus
from formwork.core.scheduler import Scheduler
from formwork.core.step_hooks import StepHooks
from formwork.gpu.executor import Executor
from formwork.gpu.model_files import load_tokenizer, resolve_model
from formwork.gpu.sampler import mask_can_wait
from formwork.grammar.manager import StructuredOutputManager
from formwork.schemas.config import EngineConfig
from formwork.schemas.sampling import check_priority, check_token_ids
from formwork.schemas.engine import EngineCoreOutputs, EngineCoreRequest, EngineStats
from formwork.schemas.scheduler import SchedulerOutput
from formwork.schemas.structured import GrammarStats

log = logging.getLogger("formwork.engine")
# Candidates checked for a refused pick before its mask is filled (a greedy row's
# best tokens; a sampled row's spare draws, gpu/sampler.SPARE_DRAWS): a check is ~7 us
# (llguidance), a mask fill ~170 us plus a second pick on the logits after the
# forward. bench/structured_overhead.py at batch 32, greedy: 489 of 781 refusals rescued, constrained / free 0.936 -> 0.971 (best of 3, A/B); at
# temperature 0.7: 94 of 129 rescued, 0.986 -> 1.005; structured_shapes' nested
# shape at 0.7: 198 of 398, 0.836 -> 0.858.
RESCUE_CANDIDATES = 8


def _make_grammar_manager(config: EngineConfig, tokenizer, vocab_size: int):
    return StructuredOutputManager(
        tokenizer, vocab_size,
        default_backend=config.structured_backend,
        num_threads=config.grammar_compile_threads,
        compile_timeout_s=config.grammar_compile_timeout_s,
        enable_jump_forward=config.enable_jump_forward,
        budget_aware=config.budget_aware,
    )


class EngineCore:
    def __init__(self, config: EngineConfig, *, executor=None, tokenizer=None,
                 structured_manager=None, hooks: StepHooks | None = None):
        self.config = config
        model_dir = resolve_model(config.model, weights=config.reads_weights) \
            if executor is None or tokenizer is None else None
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        if executor is None:
            executor = Executor(config, model_dir)
        self.executor = executor
        info = executor.info
        self.info = info
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.kv_manager = KVCacheManager(info.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.structured = (structured_manager if structured_manager is not None
                           else _make_grammar_manager(config, self.tokenizer, info.vocab_size))
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            kv_cache_manager=self.kv_manager,
            structured_output_manager=self.structured,
            scheduling_policy=config.scheduling_policy,
        )
        self._aborts: collections.deque[str] = collections.deque()
        self._abort_lock = threading.Lock()
        self._hooks = hooks if hooks is not None else StepHooks()
        self.steps = 0
        self.bitmask_seconds = 0.0
        log.info("engine ready: %d KV blocks x %d tokens, max_model_len %d, %s %s, attention %s, "
                 "CUDA graphs %s", info.num_kv_blocks, config.block_size, info.max_model_len,
                 info.device, info.dtype, info.attention_backend,
                 f"on (decode batch sizes {min(info.cuda_graph_sizes)}-"
                 f"{max(info.cuda_graph_sizes)})" if info.cuda_graph_sizes else "off")

    # -- input -----------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Raises ParamError for a request that would corrupt the engine's state (a
        prompt past the context, token ids outside the vocabulary). Trusts the rest:
        SamplingParams checked itself when built or decoded (docs/architecture.md)."""
        self.check_prompt(req.prompt_token_ids)
        check_token_ids(req.sampling_params, self.vocab_size)
        check_priority(req.sampling_params, self.config.scheduling_policy)
        self.scheduler.add_request(Request.from_engine_request(req))

    def check_prompt(self, ids: list[int]) -> None:
        """ValueError naming the parameter unless `ids` is a prompt this engine can serve."""
        check_prompt(ids, self.max_model_len, self.vocab_size)

    def abort_requests(self, request_ids) -> None:
        """Thread-safe: queued, applied at the next abort point of the engine thread."""
        with self._abort_lock:
            self._aborts.extend(request_ids)

    def apply_aborts(self) -> EngineCoreOutputs:
        """Finish the queued aborts now (engine thread, between steps): their blocks
        are free when this returns."""
        return EngineCoreOutputs(outputs=self._drain_aborts())

    def _drain_aborts(self) -> list:
        with self._abort_lock:
            ids = list(self._aborts)
            self._aborts.clear()
        if not ids:
            return []
        return self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def _trace(self, what: str) -> None:
        if self._hooks.trace is not None:
            self._hooks.trace(what)

    # -- the step ----------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        outputs = self._drain_aborts()
        self._trace("schedule")
        plan = self.scheduler.schedule()
        outputs += self.scheduler.take_finished_outputs()
        if plan.total_num_scheduled_tokens == 0:
            if plan.finished_req_ids:      # let the runner drop their state
                self.executor.execute_model(plan, non_block=False)
                self.executor.sample_tokens(None)
            return EngineCoreOutputs(outputs=outputs)
        self._trace("execute")
        self.executor.execute_model(plan, non_block=True)
        try:
            runner_out, t0, t1 = self._sample(plan)
        except Exception as e:  # a failed step: commit nothing, find its culprit(s)
            log.exception("model step failed (%d requests); isolating the culprit",
                          len(plan.num_scheduled_tokens))
            self.executor.cancel_inflight()
            outputs += self._isolate_failure(plan, e)
            self.steps += 1
            if self._hooks.check_invariants:
                self.scheduler.check_invariants()
            return EngineCoreOutputs(outputs=outputs)
        if self._hooks.on_timing is not None:
            self._hooks.on_timing({"fill_start": t0, "fill_end": t1, **self.executor.timings})
        self._trace("aborts")
        outputs += self._drain_aborts()
        self._trace("update")
        outputs += self.scheduler.update_from_output(plan, runner_out)
        self.steps += 1
        if self._hooks.check_invariants:
            self.scheduler.check_invariants()
        return EngineCoreOutputs(outputs=outputs)

    def _sample(self, plan: SchedulerOutput):
        """With the forward in flight: fill the grammar masks the step needs now,
        sample, then check the deferred picks (requests whose sampling commutes
        with the mask, gpu/sampler.py) and pick again, masked, where the grammar
        refuses one. Returns (runner output, fill start, fill end)."""
        self._trace("grammar")
        t0 = time.perf_counter()
        ids, deferred = plan.structured_req_ids, []
        if ids and self.config.defer_grammar_masks:
            reqs = self.scheduler.requests
            deferred = [r for r in ids if mask_can_wait(reqs[r].sampling_params)
                        and self.structured.can_defer(r)]
            if deferred:
                waiting = set(deferred)
                ids = [r for r in ids if r not in waiting]
        bitmask = self.structured.fill_bitmask(ids) if ids else None
        t1 = time.perf_counter()
        self._trace("wait")
        out = self.executor.sample_tokens(bitmask, ids, deferred)
        if deferred:
            row = {r: i for i, r in enumerate(out.req_ids)}
            refused = [r for r in deferred
                       if not self.structured.check_deferred(r, out.sampled_token_ids[row[r]])]
            if refused:
                refused = self._rescue(refused, out, row)
            if refused:
                t = time.perf_counter()
                bitmask = self.structured.fill_bitmask(refused)
                self.bitmask_seconds += time.perf_counter() - t
                for r, tok in zip(refused, self.executor.resample(refused, bitmask)):
                    out.sampled_token_ids[row[r]] = tok
        self.bitmask_seconds += t1 - t0
        return out, t0, t1

    def _rescue(self, refused: list[str], out, row: dict[str, int]) -> list[str]:
        """Refused picks: the first of the row's candidates the grammar allows is an
        exact masked pick (gpu/sampler.Sampler.candidates: a greedy row's next best
        tokens in masked-argmax order, a sampled row's spare draws); set it. Returns
        the requests still without a pick (no allowed candidate): they get the mask
        and a second pick."""
        left = []
        for r, cands in zip(refused, self.executor.candidates(refused, RESCUE_CANDIDATES)):
            refused_tok = out.sampled_token_ids[row[r]]
            tok = self.structured.first_allowed(r, [t for t in cands if t != refused_tok])
            if tok is None:
                left.append(r)
            else:
                out.sampled_token_ids[row[r]] = tok
        return left

    def _run_plan(self, plan: SchedulerOutput):
        """Forward + grammar bitmask + sample for `plan`, blocking; raises what fails."""
        self.executor.execute_model(plan, non_block=True)
        try:
            return self._sample(plan)[0]
        except Exception:
            self.executor.cancel_inflight()
            raise

    def _isolate_failure(self, plan: SchedulerOutput, error: Exception) -> list:
        """Second wall of isolation: re-run the failed step on halves of its batch
        (bisection) until the failing request(s) are found; only they finish with the
        error, the others' tokens of this step are committed as usual.

        Why a retry is sound: the failed attempt committed nothing (token counts,
        outputs, block hashes and grammar matchers move only in update_from_output),
        so a retry recomputes exactly the positions the failed attempt computed and
        overwrites the K/V slots it wrote. Those slots are never shared: prefix-cache
        sharing covers only full blocks hashed after a successful step, and a step
        writes only positions >= num_computed_tokens. The retry plans come from
        Scheduler.sub_plan (requests re-sent in full, so whatever runner state the
        failed attempt left is replaced). A culprit's own blocks are freed unhashed.
        Cost: about 2k*log2(n) extra forwards for k culprits among n requests; a
        failure that is not any request's (the device is gone) fails them all after
        at most 2n-2 retries. A one-request plan is its own culprit (no retry)."""
        ids = list(plan.num_scheduled_tokens)
        message = f"internal error in model step: {error}"
        if len(ids) == 1:
            return self.scheduler.fail_step(plan, message)
        outputs: list = []
        groups = [ids[len(ids) // 2:], ids[:len(ids) // 2]]      # a stack: first half first
        while groups:
            group = groups.pop()
            outputs += self._drain_aborts()
            sub = self.scheduler.sub_plan(plan, group)
            if sub.total_num_scheduled_tokens == 0:            # all aborted meanwhile
                continue
            try:
                runner_out = self._run_plan(sub)
            except Exception as e:
                if len(sub.num_scheduled_tokens) == 1:
                    rid = next(iter(sub.num_scheduled_tokens))
                    log.error("request %s fails the model step: %s", rid, e)
                    outputs += self.scheduler.fail_step(sub, f"internal error in model step: {e}")
                else:
                    half = len(group) // 2
                    groups += [group[half:], group[:half]]
                continue
            outputs += self._drain_aborts()
            outputs += self.scheduler.update_from_output(sub, runner_out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        with self._abort_lock:
            pending_aborts = bool(self._aborts)
        return self.scheduler.has_unfinished_requests() or pending_aborts

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's `reset_prefix_cache`: the next requests
        find no prefix hits); False, and nothing changed, while a request holds
        blocks."""
        return self.kv_manager.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        s, kv = self.scheduler, self.kv_manager
        g = self.structured.stats() if self.structured is not None else GrammarStats()
        governor = getattr(self.executor, "governor", None)
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting,
            num_waiting_for_grammar=s.num_waiting_for_grammar,
            kv_total_blocks=self.info.num_kv_blocks, kv_free_blocks=kv.num_allocatable_blocks,
            kv_cached_blocks=kv.num_cached_blocks,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            grammar_compiles=g.compiles, grammar_cache_hits=g.cache_hits,
            grammar_compile_seconds=g.compile_seconds,
            bitmask_seconds=self.bitmask_seconds, grammar_deferred_checks=g.deferred_checks,
            grammar_deferred_refused=g.deferred_refused,
            grammar_deferred_rescued=g.deferred_rescued, steps=self.steps,
            forward_threads=governor.threads if governor is not None else 0,
            thread_resizes=governor.resizes if governor is not None else 0,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self.structured is not None and hasattr(self.structured, "shutdown"):
            self.structured.shutdown()
