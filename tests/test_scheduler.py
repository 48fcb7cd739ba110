"""Scheduler against a fake runner that keeps a fake paged K/V store: each sampled
token is a hash of the sequence READ BACK from the store through the block
table, so wrong block ids, lost prefix blocks or wrong token diffs change the
output. Every scheduling (chunked, preempted, prefix-hit) must reproduce the
reference: greedy generation with the same hash."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import event, given, settings, strategies as st

from formwork.core import policy
from formwork.core.kv_cache import KVCacheManager
from formwork.core.request import Request, RequestStatus
from formwork.core.scheduler import Scheduler
from formwork.schemas.engine import FinishReason
from formwork.schemas.sampling import SamplingParams
from formwork.schemas.scheduler import ModelRunnerOutput, SchedulerOutput
from formwork.schemas.structured import StructuredOutputsParams

BS = 4
EOS = 3


def det_token(seq: list[int]) -> int:
    h = 0
    for t in seq:
        h = (h * 1000003 + t + 1) % (1 << 61)
    return 10 + h % 990        # never a small id (EOS, stop ids) unless scripted


def reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(det_token(seq))
    return seq[len(prompt):]


@dataclass
class _RunnerReq:
    tokens: list[int]
    computed: int
    blocks: list[int]
    prompt_len: int
    params: SamplingParams


class FakeRunner:
    """Persistent per-request state built only from SchedulerOutputs."""

    def __init__(self, script=None):
        self.slots: dict[int, tuple[int, int]] = {}      # slot -> (position, token)
        self.reqs: dict[str, _RunnerReq] = {}
        self.script = script    # (req_id, num_output_so_far, seq) -> token | None

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        for rid in plan.finished_req_ids:
            self.reqs.pop(rid, None)
        for nr in plan.new_reqs:
            assert nr.req_id not in self.reqs, f"{nr.req_id} sent twice"
            self.reqs[nr.req_id] = _RunnerReq(nr.prompt_token_ids + nr.output_token_ids,
                                              nr.num_computed_tokens, list(nr.block_ids),
                                              len(nr.prompt_token_ids), nr.sampling_params)
        for cr in plan.cached_reqs:
            r = self.reqs[cr.req_id]
            assert r.computed == cr.num_computed_tokens, (cr.req_id, r.computed, cr.num_computed_tokens)
            r.blocks += cr.new_block_ids
            for k, t in enumerate(cr.new_token_ids):
                p = cr.num_computed_tokens + k
                if p < len(r.tokens):
                    assert r.tokens[p] == t, f"{cr.req_id}: token at {p} changed"
                else:
                    assert p == len(r.tokens)
                    r.tokens.append(t)
        assert {r.req_id for r in plan.new_reqs} | {r.req_id for r in plan.cached_reqs} \
            == set(plan.num_scheduled_tokens)
        assert plan.total_num_scheduled_tokens == sum(plan.num_scheduled_tokens.values())
        for rid, n in plan.num_scheduled_tokens.items():
            self._compute(rid, n)
        toks, lps = [], []
        for rid in plan.sampling_req_ids:
            r = self.reqs[rid]
            assert r.computed == len(r.tokens), f"{rid}: sampled before its last token"
            seq = [self.slots[self._slot(r, p)][1] for p in range(r.computed)]
            tok = self.script(rid, len(seq) - r.prompt_len, seq) if self.script else None
            toks.append(det_token(seq) if tok is None else tok)
            lps.append((-0.25, [(toks[-1], -0.25), (toks[-1] + 1, -2.0)], 1)
                       if r.params.logprobs is not None else None)
        return ModelRunnerOutput(list(plan.sampling_req_ids), toks, lps)

    @staticmethod
    def _slot(r: _RunnerReq, p: int) -> int:
        return r.blocks[p // BS] * BS + p % BS

    def _compute(self, rid: str, n: int) -> None:
        r = self.reqs[rid]
        c = r.computed
        assert c + n <= len(r.tokens) and c + n <= len(r.blocks) * BS, (rid, c, n)
        for p in range(c):      # attention reads the whole prefix through the block table
            assert self.slots.get(self._slot(r, p)) == (p, r.tokens[p]), f"{rid}: K/V at {p} lost"
        for p in range(c, c + n):
            self.slots[self._slot(r, p)] = (p, r.tokens[p])
        r.computed = c + n


class FakeSOM:
    """Structured-output manager double: status set by the test; token TERM ends
    the grammar; jump_forward serves queued forced continuations."""
    TERM = 7

    def __init__(self):
        self.state: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.accepted: dict[str, list[int]] = {}
        self.forced: dict[str, list[list[int]]] = {}
        self.reject: set[int] = set()
        self.removed: list[str] = []
        self.budgets: dict[str, int | None] = {}
        self.closed: set[str] = set()       # ids budget-aware decoding closed
        self.guards: dict[str, dict[int, int]] = {}   # id -> {pick: the token committed instead}
        self.guarded: list[tuple[str, int]] = []      # (id, pick) as budget_guard saw them

    def submit(self, request_id, params, budget=None):
        self.state[request_id] = "pending"
        self.accepted[request_id] = []
        self.budgets[request_id] = budget

    def status(self, request_id):
        return self.state[request_id]

    def error(self, request_id):
        return self.errors.get(request_id, "")

    def accept_tokens(self, request_id, token_ids):
        if any(t in self.reject for t in token_ids):
            return False
        self.accepted[request_id] += token_ids
        return True

    def is_terminated(self, request_id):
        return bool(self.accepted[request_id]) and self.accepted[request_id][-1] == self.TERM

    def budget_closed(self, request_id):
        return request_id in self.closed

    def budget_guard(self, request_id, token_id):
        self.guarded.append((request_id, token_id))
        return self.guards.get(request_id, {}).get(token_id)

    def jump_forward_tokens(self, request_id):
        queue = self.forced.get(request_id)
        toks = queue.pop(0) if queue else []
        self.accepted[request_id] += toks
        return toks

    def remove(self, request_id):
        self.removed.append(request_id)


def make_sched(*, num_blocks=64, budget=32, max_num_seqs=8, max_model_len=128, chunked=True,
               caching=True, som=None, threshold=0, policy="fcfs") -> Scheduler:
    return Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_model_len, enable_chunked_prefill=chunked,
                     kv_cache_manager=KVCacheManager(num_blocks, BS, caching),
                     structured_output_manager=som, long_prefill_token_threshold=threshold,
                     scheduling_policy=policy)


def req(rid, prompt, arrival=0.0, structured=False, **sp) -> Request:
    sp.setdefault("max_tokens", 8)
    if structured:
        sp["structured_outputs"] = StructuredOutputsParams(regex="[a-z]+")
    return Request(rid, list(prompt), SamplingParams(**sp), eos_token_id=EOS, arrival_time=arrival)


@dataclass
class Collected:
    tokens: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    stop_reason: object = None
    cached: int = 0
    error: str | None = None
    logprobs: list = field(default_factory=list)


def step(sched: Scheduler, runner: FakeRunner, results: dict, between=None) -> SchedulerOutput:
    """One engine step as EngineCore runs it: an empty plan is neither executed nor updated."""
    plan = sched.schedule()
    assert plan.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    outs = sched.take_finished_outputs()
    if not plan.is_empty:
        out = runner.execute(plan)
        outs += between(plan) if between else []
        outs += sched.update_from_output(plan, out)
    for o in outs:
        c = results.setdefault(o.request_id, Collected())
        assert c.finish is None, f"{o.request_id}: output after finish"
        c.tokens += o.new_token_ids
        c.finish, c.stop_reason, c.cached, c.error = o.finish_reason, o.stop_reason, o.num_cached_tokens, o.error
        c.logprobs += o.new_logprobs or []
    sched.check_invariants()
    return plan


def run_all(sched: Scheduler, runner: FakeRunner, results=None, max_steps=400) -> dict[str, Collected]:
    results = {} if results is None else results
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        step(sched, runner, results)
    assert not sched.has_unfinished_requests()
    kv = sched.kv
    assert kv.num_free_blocks + kv.num_cached_blocks == kv.num_blocks
    return results


# ---- end-to-end through the fake runner ---------------------------------

def test_outputs_match_reference_and_finish_length():
    sched, runner = make_sched(), FakeRunner()
    prompts = {f"r{i}": list(range(i, i + 5 + 3 * i)) for i in range(4)}
    for rid, p in prompts.items():
        sched.add_request(req(rid, p, max_tokens=6))
    res = run_all(sched, runner)
    for rid, p in prompts.items():
        assert res[rid].tokens == reference(p, 6) and res[rid].finish == FinishReason.LENGTH


def test_budget_and_chunked_prefill_split():
    sched, runner, res = make_sched(budget=8), FakeRunner(), {}
    sched.add_request(req("a", range(20), max_tokens=3))
    plans = [step(sched, runner, res) for _ in range(3)]
    assert [p.num_scheduled_tokens for p in plans] == [{"a": 8}, {"a": 8}, {"a": 4}]
    assert [p.sampling_req_ids for p in plans] == [[], [], ["a"]]
    assert plans[1].cached_reqs[0].new_token_ids == list(range(8, 16))
    assert res["a"].tokens == reference(range(20), 1)
    run_all(sched, runner, res)
    assert res["a"].tokens == reference(range(20), 3)


def test_long_prefill_threshold_caps_chunks():
    sched, runner, res = make_sched(budget=32, threshold=6), FakeRunner(), {}
    sched.add_request(req("a", range(14), max_tokens=1))
    assert [step(sched, runner, res).num_scheduled_tokens["a"] for _ in range(3)] == [6, 6, 2]


def test_no_chunked_prefill_all_or_nothing():
    sched, runner, res = make_sched(budget=16, chunked=False), FakeRunner(), {}
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add_request(req("big", range(17)))
    sched.add_request(req("a", range(10), max_tokens=2))
    sched.add_request(req("b", range(100, 110), max_tokens=2))
    sched.add_request(req("c", range(2), max_tokens=2))
    # b would need 10 > 6; c would fit but must not overtake b (FCFS)
    assert step(sched, runner, res).num_scheduled_tokens == {"a": 10}
    assert list(step(sched, runner, res).num_scheduled_tokens.items()) == [("a", 1), ("b", 10), ("c", 2)]
    run_all(sched, runner, res)
    assert res["b"].tokens == reference(range(100, 110), 2)


def test_fcfs_and_max_num_seqs():
    sched, runner, res = make_sched(max_num_seqs=2), FakeRunner(), {}
    for i in range(5):
        sched.add_request(req(f"r{i}", [i] * 3, max_tokens=2 + i % 2))
    admitted = []
    while sched.has_unfinished_requests():
        admitted += [n.req_id for n in step(sched, runner, res).new_reqs]
    assert admitted == [f"r{i}" for i in range(5)]
    for i in range(5):
        assert res[f"r{i}"].tokens == reference([i] * 3, 2 + i % 2)


def test_preemption_recomputes_to_identical_outputs():
    # 12 blocks x 4 = 48 slots for 3 requests that want 3 x (6 + 14) = 60
    sched, runner, res = make_sched(num_blocks=12, caching=False), FakeRunner(), {}
    prompts = {f"r{i}": [i + 1] * 6 for i in range(3)}
    for i, (rid, p) in enumerate(prompts.items()):
        sched.add_request(req(rid, p, arrival=float(i), max_tokens=14))
    preempted, readmitted = [], []
    while sched.has_unfinished_requests():
        before = sched.num_preemptions
        plan = step(sched, runner, res)
        if sched.num_preemptions > before:
            preempted += sorted(plan.finished_req_ids)
            assert not plan.new_reqs      # no admissions in a step that preempted
        readmitted += [n.req_id for n in plan.new_reqs if n.output_token_ids]
    assert sched.num_preemptions >= 1 and preempted[0] == "r2"     # latest arrival first
    assert readmitted and readmitted[0] == "r2"
    for rid, p in prompts.items():
        assert res[rid].tokens == reference(p, 14), rid


def test_preemption_with_prefix_cache_resumes_from_hit():
    sched, runner, res = make_sched(num_blocks=12), FakeRunner(), {}
    for i in range(3):
        sched.add_request(req(f"r{i}", [i + 1] * 6, arrival=float(i), max_tokens=14))
    new_computed = []
    while sched.has_unfinished_requests():
        plan = step(sched, runner, res)
        new_computed += [n.num_computed_tokens for n in plan.new_reqs if n.output_token_ids]
    assert sched.num_preemptions >= 1 and any(c > 0 for c in new_computed)
    for i in range(3):   # num_cached_tokens is the hit at the FIRST schedule
        assert res[f"r{i}"].tokens == reference([i + 1] * 6, 14) and res[f"r{i}"].cached == 0


def test_victim_is_latest_arrival_among_unscheduled():
    sched, runner, res = make_sched(num_blocks=5, caching=False), FakeRunner(), {}
    sched.add_request(req("late", range(7), arrival=5.0, max_tokens=10))
    sched.add_request(req("early", range(20, 27), arrival=1.0, max_tokens=10))
    first = None
    while sched.has_unfinished_requests():
        before = sched.num_preemptions
        plan = step(sched, runner, res)
        if first is None and sched.num_preemptions > before:
            first = plan
    # "late" was already scheduled this step when "early" ran out: early yields
    assert first.finished_req_ids == {"early"} and list(first.num_scheduled_tokens) == ["late"]
    assert res["late"].tokens == reference(range(7), 10)
    assert res["early"].tokens == reference(range(20, 27), 10)


def test_prefix_hit_skips_computed_tokens():
    sched, runner, res = make_sched(), FakeRunner(), {}
    sched.add_request(req("a", range(18), max_tokens=2))
    run_all(sched, runner, res)
    hits_before = sched.kv.prefix_cache_hits
    b_prompt = list(range(16)) + [99, 98, 97]
    sched.add_request(req("b", b_prompt, max_tokens=4))
    plan = step(sched, runner, res)
    assert plan.new_reqs[0].num_computed_tokens == 16 and plan.num_scheduled_tokens == {"b": 3}
    run_all(sched, runner, res)
    assert res["b"].tokens == reference(b_prompt, 4) and res["b"].cached == 16
    assert sched.kv.prefix_cache_hits - hits_before == 16


def test_abort_between_schedule_and_update():
    sched, runner, res = make_sched(), FakeRunner(), {}
    sched.add_request(req("a", range(6), max_tokens=10))
    sched.add_request(req("b", range(50, 56), max_tokens=10))
    sched.add_request(req("w", range(5), max_tokens=10))
    step(sched, runner, res)
    aborted = step(sched, runner, res, between=lambda plan: sched.finish_requests(["a", "a", "zz"]))
    assert "a" in aborted.num_scheduled_tokens
    assert res["a"].finish == FinishReason.ABORT and len(res["a"].tokens) == 1
    assert not sched.kv.holds("a") and sched.finish_requests(["a"]) == []
    nxt = step(sched, runner, res)
    assert "a" in nxt.finished_req_ids and "a" not in nxt.num_scheduled_tokens
    run_all(sched, runner, res)
    assert res["b"].tokens == reference(range(50, 56), 10)


def test_finished_ids_wait_for_a_non_empty_plan():
    sched, runner, res = make_sched(), FakeRunner(), {}
    sched.add_request(req("a", range(6), max_tokens=10))
    step(sched, runner, res)
    assert sched.finish_requests(["a"])[0].finish_reason == FinishReason.ABORT
    empty = sched.schedule()
    assert empty.is_empty and not empty.finished_req_ids
    sched.add_request(req("a", range(6), max_tokens=2))      # same id, new request
    plan = step(sched, runner, res)                          # runner asserts no double "a"
    assert plan.finished_req_ids == {"a"} and plan.new_reqs[0].req_id == "a"


def test_abort_waiting_request():
    sched, runner, res = make_sched(max_num_seqs=1), FakeRunner(), {}
    sched.add_request(req("a", range(6), max_tokens=3))
    sched.add_request(req("b", range(6), max_tokens=3))
    step(sched, runner, res)
    outs = sched.finish_requests("b")
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outs] == [("b", FinishReason.ABORT, [])]
    sched.check_invariants()
    assert "b" not in run_all(sched, runner, res)      # never emitted a token


@pytest.mark.parametrize("script, sp, want_tokens, finish, stop_reason", [
    ([11, EOS, 12], {}, [11, EOS], FinishReason.STOP, None),
    ([11, EOS, 12, EOS, 13], {"min_tokens": 3}, [11, EOS, 12, EOS], FinishReason.STOP, None),
    ([11, EOS, 12, EOS], {"ignore_eos": True, "max_tokens": 4}, [11, EOS, 12, EOS], FinishReason.LENGTH, None),
    ([11, 12, 5, 13], {"stop_token_ids": [5, 6]}, [11, 12, 5], FinishReason.STOP, 5),
    ([11, 5, 13, 14], {"stop_token_ids": [5], "min_tokens": 3, "max_tokens": 3}, [11, 5, 13],
     FinishReason.LENGTH, None),
    ([11, 12, 13, 14, 15], {"max_tokens": 3}, [11, 12, 13], FinishReason.LENGTH, None),
])
def test_stop_conditions(script, sp, want_tokens, finish, stop_reason):
    sp = {"max_tokens": 10, **sp}
    runner = FakeRunner(script=lambda rid, i, seq: script[i])
    sched, res = make_sched(), {}
    sched.add_request(req("a", range(5), **sp))
    run_all(sched, runner, res)
    assert (res["a"].tokens, res["a"].finish, res["a"].stop_reason) == (want_tokens, finish, stop_reason)


def test_max_model_len_caps_length():
    sched, runner = make_sched(max_model_len=14), FakeRunner()
    with pytest.raises(AssertionError, match="max_model_len"):   # the engine's door refuses it
        sched.add_request(req("x", range(14)))
    sched.add_request(req("a", range(10), max_tokens=100))
    res = run_all(sched, runner)
    assert res["a"].tokens == reference(range(10), 4) and res["a"].finish == FinishReason.LENGTH


def test_kv_capacity_alone_finishes_length():
    sched, runner = make_sched(num_blocks=4, max_model_len=64), FakeRunner()   # 16 slots
    sched.add_request(req("a", range(10), max_tokens=20))
    res = run_all(sched, runner)
    assert res["a"].tokens == reference(range(10), 7) and res["a"].finish == FinishReason.LENGTH


def test_logprobs_mapped():
    sched, runner = make_sched(), FakeRunner()
    sched.add_request(req("a", range(5), max_tokens=2, logprobs=1))
    res = run_all(sched, runner)
    lp = res["a"].logprobs
    assert [(x.chosen.token_id, x.chosen.logprob) for x in lp] == [(t, -0.25) for t in res["a"].tokens]
    assert [[(y.token_id, y.logprob) for y in x.top] for x in lp][0] == \
        [(res["a"].tokens[0], -0.25), (res["a"].tokens[0] + 1, -2.0)]


def test_fail_step_commits_nothing_and_frees_once():
    sched, runner, res = make_sched(max_num_seqs=1), FakeRunner(), {}
    sched.add_request(req("a", range(6), max_tokens=5))
    sched.add_request(req("b", range(9), max_tokens=2))
    step(sched, runner, res)
    plan = sched.schedule()
    outs = sched.fail_step(plan, "device lost")
    assert [(o.request_id, o.finish_reason, o.error, o.new_token_ids) for o in outs] == \
        [("a", FinishReason.ERROR, "device lost", [])]
    assert not sched.kv.holds("a")
    sched.check_invariants()
    res = run_all(sched, runner)
    assert res["b"].tokens == reference(range(9), 2)


def test_add_request_validation():
    sched = make_sched(num_blocks=4, max_model_len=64)
    with pytest.raises(AssertionError):      # the engine's door refuses it (core/prompt_check.py)
        sched.add_request(req("e", []))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(req("big", range(16)))
    sched.add_request(req("a", range(3)))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(req("a", range(3)))
    with pytest.raises(ValueError, match="structured"):
        sched.add_request(req("s", range(3), structured=True))
    assert list(sched.requests) == ["a"]


# ---- structured outputs with a fake manager -----------------------------

def test_grammar_pending_does_not_block_then_ready():
    som = FakeSOM()
    sched, runner, res = make_sched(som=som), FakeRunner(), {}
    sched.add_request(req("s", range(5), structured=True, max_tokens=3))
    sched.add_request(req("p", range(20, 25), max_tokens=3))
    plan = step(sched, runner, res)
    assert list(plan.num_scheduled_tokens) == ["p"] and sched.num_waiting_for_grammar == 1
    som.state["s"] = "ready"
    plan = step(sched, runner, res)
    assert plan.structured_req_ids == ["s"] and set(plan.sampling_req_ids) == {"p", "s"}
    run_all(sched, runner, res)
    assert res["s"].tokens == reference(range(5), 3) and som.accepted["s"] == res["s"].tokens
    assert som.removed == ["s"]


def test_structured_partial_prefill_needs_no_bitmask():
    som = FakeSOM()
    sched, runner, res = make_sched(som=som, budget=8), FakeRunner(), {}
    sched.add_request(req("s", range(12), structured=True, max_tokens=2))
    som.state["s"] = "ready"
    plans = [step(sched, runner, res) for _ in range(2)]
    assert [(p.sampling_req_ids, p.structured_req_ids) for p in plans] == [([], []), (["s"], ["s"])]


def test_grammar_failed_errors_alone():
    som = FakeSOM()
    sched, runner, res = make_sched(som=som), FakeRunner(), {}
    sched.add_request(req("s", range(5), structured=True))
    sched.add_request(req("p", range(20, 25), max_tokens=3))
    som.state["s"], som.errors["s"] = "failed", "bad schema: x"
    run_all(sched, runner, res)
    assert (res["s"].finish, res["s"].error, res["s"].tokens) == (FinishReason.ERROR, "bad schema: x", [])
    assert res["p"].tokens == reference(range(20, 25), 3) and som.removed == ["s"]


def test_grammar_terminated_stops_and_rejection_errors():
    som = FakeSOM()
    som.reject = {9}
    script = {"t": [11, FakeSOM.TERM, 12], "x": [11, 9, 12]}
    runner = FakeRunner(script=lambda rid, i, seq: script[rid][i])
    sched, res = make_sched(som=som), {}
    for rid in script:
        sched.add_request(req(rid, range(5), structured=True))
        som.state[rid] = "ready"
    run_all(sched, runner, res)
    assert (res["t"].tokens, res["t"].finish) == ([11, FakeSOM.TERM], FinishReason.STOP)
    assert (res["x"].tokens, res["x"].finish, res["x"].error) == \
        ([11, 9], FinishReason.ERROR, "grammar rejected token")


def test_budget_closed_output_finishes_with_length():
    """A grammar end that budget-aware decoding steered to is max_tokens' doing:
    "length", not "stop". The manager is told each request's token budget."""
    som = FakeSOM()
    script = {"t": [11, FakeSOM.TERM], "c": [11, FakeSOM.TERM]}
    runner = FakeRunner(script=lambda rid, i, seq: script[rid][i])
    sched, res = make_sched(som=som, max_model_len=128), {}
    sched.add_request(req("t", range(5), structured=True, max_tokens=6))
    sched.add_request(req("c", range(120), structured=True, max_tokens=20))
    som.state.update(t="ready", c="ready")
    som.closed.add("c")
    run_all(sched, runner, res)
    assert som.budgets == {"t": 6, "c": 8}           # max_tokens, or the context's room
    assert (res["t"].finish, res["c"].finish) == (FinishReason.STOP, FinishReason.LENGTH)


def test_a_guarded_pick_is_replaced_before_the_grammar_sees_it():
    """Budget-aware decoding's guard (grammar/budget.guard) sees every sampled token of
    a structured request before it is committed; a replacement is what the output,
    the grammar and the next step get."""
    som = FakeSOM()
    script = {"g": [11, 12, FakeSOM.TERM]}
    runner = FakeRunner(script=lambda rid, i, seq: script[rid][i])
    sched, res = make_sched(som=som), {}
    sched.add_request(req("g", range(5), structured=True, max_tokens=6))
    som.state["g"], som.guards["g"] = "ready", {12: 40}
    step(sched, runner, res)
    plan = step(sched, runner, res)
    assert res["g"].tokens == [11, 40] and som.accepted["g"] == [11, 40]
    assert som.guarded == [("g", 11), ("g", 12)]
    third = step(sched, runner, res)
    assert plan.cached_reqs[0].new_token_ids == [11] and third.cached_reqs[0].new_token_ids == [40]
    assert res["g"].tokens == [11, 40, FakeSOM.TERM]
    assert res["g"].finish == FinishReason.STOP


def test_jump_forward_appended_and_scheduled():
    som = FakeSOM()
    sched, runner, res = make_sched(som=som), FakeRunner(), {}
    sched.add_request(req("s", range(5), structured=True, max_tokens=6))
    som.state["s"], som.forced["s"] = "ready", [[500, 501]]
    step(sched, runner, res)
    t0 = det_token(list(range(5)))
    assert res["s"].tokens == [t0, 500, 501]
    plan = step(sched, runner, res)
    assert plan.num_scheduled_tokens == {"s": 3} and plan.cached_reqs[0].new_token_ids == [t0, 500, 501]
    run_all(sched, runner, res)
    seq = list(range(5)) + [t0, 500, 501]
    assert res["s"].tokens == [t0, 500, 501] + reference(seq, 3)


def test_jump_forward_cut_by_max_tokens():
    som = FakeSOM()
    sched, runner = make_sched(som=som), FakeRunner()
    sched.add_request(req("s", range(5), structured=True, max_tokens=2))
    som.state["s"], som.forced["s"] = "ready", [[500, 501]]
    res = run_all(sched, runner)
    assert res["s"].tokens == [det_token(list(range(5))), 500] and res["s"].finish == FinishReason.LENGTH


# ---- random interleavings --------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "add", "step", "abort"]), st.integers(0, 7)),
                    min_size=3, max_size=40),
       num_blocks=st.integers(5, 12), budget=st.sampled_from([4, 8, 16]))
def test_random_interleavings_keep_invariants(ops, num_blocks, budget):
    sched, runner, res, prompts = make_sched(num_blocks=num_blocks, budget=budget, max_num_seqs=3), \
        FakeRunner(), {}, {}
    for op, k in ops:
        if op == "add":
            rid = f"r{len(prompts)}"
            prompts[rid] = [k % 3] * 4 + [k] * (k % 5 + 1)     # shared prefixes
            sched.add_request(req(rid, prompts[rid], arrival=float(len(prompts)), max_tokens=2 * k + 1))
        elif op == "abort" and prompts:
            rid = f"r{k % len(prompts)}"
            step(sched, runner, res, between=lambda plan: sched.finish_requests([rid]))
        else:
            step(sched, runner, res)
    run_all(sched, runner, res)
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix hit: {sched.kv.prefix_cache_hits > 0}")
    for rid, p in prompts.items():
        c = res.get(rid, Collected())
        if c.finish == FinishReason.ABORT:
            assert c.tokens == reference(p, len(c.tokens))
        else:
            assert c.tokens == reference(p, len(c.tokens)) and c.finish == FinishReason.LENGTH


# ---- policy tables ---------------------------------------------------------

@pytest.mark.parametrize("remaining, budget, room, partial, thr, want", [
    (10, 32, 100, True, 0, 10), (10, 4, 100, True, 0, 4), (10, 4, 100, False, 0, 0),
    (10, 10, 100, False, 0, 10), (10, 32, 6, True, 0, 6), (10, 32, 100, True, 3, 3),
    (2, 32, 100, True, 3, 2), (10, 0, 100, True, 0, 0),
])
def test_fit_chunk(remaining, budget, room, partial, thr, want):
    assert policy.fit_chunk(remaining, budget, room=room, allow_partial=partial,
                            long_prefill_threshold=thr) == want


@pytest.mark.parametrize("arrivals, want", [([0.0], 0), ([1.0, 3.0, 2.0], 1), ([0.0, 0.0, 0.0], 2),
                                            ([5.0, 1.0], 0)])
def test_pick_victim(arrivals, want):
    assert policy.pick_victim(arrivals) == want


@pytest.mark.parametrize("c, n, total, want", [(0, 5, 5, True), (0, 4, 5, False), (7, 1, 8, True),
                                               (7, 3, 10, True)])
def test_samples_this_step(c, n, total, want):
    assert policy.samples_this_step(c, n, total) is want


@pytest.mark.parametrize("tok, n_out, n_tok, sp, want", [
    (EOS, 1, 6, {}, (RequestStatus.FINISHED_STOPPED, None)),
    (EOS, 1, 6, {"ignore_eos": True}, (None, None)),
    (EOS, 1, 6, {"min_tokens": 2}, (None, None)),
    (5, 2, 7, {"stop_token_ids": [5]}, (RequestStatus.FINISHED_STOPPED, 5)),
    (8, 4, 9, {"max_tokens": 4}, (RequestStatus.FINISHED_LENGTH_CAPPED, None)),
    (8, 1, 20, {}, (RequestStatus.FINISHED_LENGTH_CAPPED, None)),   # max_model_len 20
    (EOS, 1, 20, {"min_tokens": 2}, (RequestStatus.FINISHED_LENGTH_CAPPED, None)),
    (8, 1, 19, {}, (None, None)),
])
def test_check_stop(tok, n_out, n_tok, sp, want):
    got = policy.check_stop(tok, num_output_tokens=n_out, num_tokens=n_tok, eos_token_id=EOS,
                            params=SamplingParams(**sp), max_model_len=20)
    assert got == want


@pytest.mark.parametrize("n, blocks, chunked, want", [
    (10, 4, True, None), (10, 5, True, "KV blocks"), (40, 3, False, "max_num_batched_tokens"),
    (32, 3, False, None),
])
def test_admission_error(n, blocks, chunked, want):
    got = policy.admission_error(n, blocks_needed=blocks, num_blocks=4, chunked=chunked,
                                 max_num_batched_tokens=32)
    assert got == want if want is None else want in got


@pytest.mark.parametrize("prompt, max_tokens, want", [(10, None, 118), (10, 5, 5), (120, 50, 8)])
def test_token_budget(prompt, max_tokens, want):
    assert policy.token_budget(prompt, max_tokens, max_model_len=128) == want


def test_scheduler_check_invariants_can_fail():
    sched, runner, res = make_sched(), FakeRunner(), {}
    sched.add_request(req("a", range(6)))
    step(sched, runner, res)
    sched.running[0].num_computed_tokens = 99
    with pytest.raises(AssertionError, match="computed 99"):
        sched.check_invariants()


def test_sub_plans_after_a_failed_attempt_reproduce_the_reference():
    """A failed step's attempt wrote K/V slots and runner state but committed nothing;
    sub-plans of it (EngineCore's culprit search) recompute the same positions: the
    others' outputs are the reference, with prefix hits and chunked prefill, and the
    culprit alone fails."""
    sched, runner, res = make_sched(budget=40), FakeRunner(), {}
    sched.add_request(req("a", range(10), max_tokens=6))
    sched.add_request(req("b", range(50, 59), max_tokens=6))
    step(sched, runner, res)
    step(sched, runner, res)
    sched.add_request(req("c", list(range(10)) + [99, 98, 97], max_tokens=6))   # prefix hit on a
    sched.add_request(req("d", range(200, 240), max_tokens=3))                   # chunked
    plan = sched.schedule()
    assert set(plan.num_scheduled_tokens) == {"a", "b", "c", "d"}
    runner.execute(plan)                            # the failed attempt: nothing committed
    sched.check_invariants()
    for group in (["a", "c"], ["d"]):
        sub = sched.sub_plan(plan, group)
        assert [r.req_id for r in sub.new_reqs] == group and not sub.cached_reqs
        assert sub.finished_req_ids == set(group)
        assert all(r.block_ids == sched.kv.get_block_ids(r.req_id) for r in sub.new_reqs)
        for o in sched.update_from_output(sub, runner.execute(sub)):
            res.setdefault(o.request_id, Collected()).tokens += o.new_token_ids
        sched.check_invariants()
    outs = sched.fail_step(sched.sub_plan(plan, ["b"]), "bad")
    assert [(o.request_id, o.finish_reason) for o in outs] == [("b", FinishReason.ERROR)]
    sched.check_invariants()
    res = run_all(sched, runner, res)
    assert res["a"].tokens == reference(range(10), 6)
    assert res["c"].tokens == reference(list(range(10)) + [99, 98, 97], 6)
    assert res["c"].cached > 0
    assert res["d"].tokens == reference(range(200, 240), 3)
    sched.check_invariants()
