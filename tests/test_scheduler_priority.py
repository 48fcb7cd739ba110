"""scheduling_policy "priority" (vLLM's --scheduling-policy priority): waiting
requests by (priority, arrival), preemption takes the highest (priority,
arrival); outputs unchanged. The fake runner and helpers of test_scheduler.py."""
from __future__ import annotations

import pytest

from formwork import LLM, SamplingParams
from test_scheduler import FakeRunner, make_sched, reference, req, run_all, step


def test_lower_priority_values_are_admitted_first():
    sched, runner, res = make_sched(max_num_seqs=1, policy="priority"), FakeRunner(), {}
    for i, prio in enumerate([3, 1, 2, 1, 0]):
        sched.add_request(req(f"r{i}", [i + 1] * 3, arrival=float(i), max_tokens=2, priority=prio))
    admitted = []
    while sched.has_unfinished_requests():
        admitted += [n.req_id for n in step(sched, runner, res).new_reqs]
    assert admitted == ["r4", "r1", "r3", "r2", "r0"]       # ties: the earlier arrival
    for i in range(5):
        assert res[f"r{i}"].tokens == reference([i + 1] * 3, 2)


def test_a_later_request_of_lower_value_takes_the_next_seat():
    """Every seat taken: an urgent request takes the seat of the running request of the
    highest value (it recomputes later, same tokens); equal values wait their turn."""
    sched, runner, res = make_sched(max_num_seqs=1, policy="priority"), FakeRunner(), {}
    for i in range(3):
        sched.add_request(req(f"bulk{i}", [i + 1] * 3, arrival=float(i), max_tokens=4))
    step(sched, runner, res)                                  # bulk0 runs
    sched.add_request(req("same", [8] * 3, arrival=9.0, max_tokens=2))
    sched.add_request(req("urgent", [9] * 3, arrival=10.0, max_tokens=2, priority=-1))
    admitted, preempted = [], []
    while sched.has_unfinished_requests():
        plan = step(sched, runner, res)
        admitted += [n.req_id for n in plan.new_reqs]
        preempted += [r for r in plan.finished_req_ids if r in sched.requests]
    assert admitted == ["urgent", "bulk0", "bulk1", "bulk2", "same"]
    assert preempted == ["bulk0"]
    assert res["urgent"].tokens == reference([9] * 3, 2)
    for i in range(3):
        assert res[f"bulk{i}"].tokens == reference([i + 1] * 3, 4)


@pytest.mark.parametrize("policy,first_victim", [("fcfs", "r2"), ("priority", "r0")])
def test_preemption_takes_the_highest_priority_value(policy, first_victim):
    """12 blocks x 4 slots for 3 requests wanting 60: FCFS preempts the latest
    arrival, the priority policy the highest value (r0: 5) although it came first;
    the preempted request recomputes to the same tokens."""
    sched, runner, res = make_sched(num_blocks=12, caching=False, policy=policy), FakeRunner(), {}
    prompts = {f"r{i}": [i + 1] * 6 for i in range(3)}
    for i, ((rid, p), prio) in enumerate(zip(prompts.items(), [5, 0, 1])):
        sched.add_request(req(rid, p, arrival=float(i), max_tokens=14,
                              priority=prio if policy == "priority" else 0))
    preempted = []
    while sched.has_unfinished_requests():
        before = sched.num_preemptions
        plan = step(sched, runner, res)
        if sched.num_preemptions > before:
            preempted += sorted(plan.finished_req_ids)
    assert preempted and preempted[0] == first_victim
    run_all(sched, runner, res)
    for rid, p in prompts.items():
        assert res[rid].tokens == reference(p, 14), rid


def test_the_offline_api_takes_vllm_priority_argument():
    llm = LLM(engine_process=False, max_num_seqs=1, scheduling_policy="priority")
    try:
        order = []
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        outs = llm.generate(["a", "b", "c"], sp, priority=[2, 0, 1], use_tqdm=False,
                            on_finished=lambda i, o: order.append(i))
        assert order == [1, 2, 0] and all(len(o.outputs[0].token_ids) == 2 for o in outs)
        with pytest.raises(ValueError, match="priority: got 1 for 3"):
            llm.generate(["a", "b", "c"], sp, priority=[1])
    finally:
        llm.shutdown()
    fcfs = LLM(engine_process=False, max_num_seqs=1)
    try:
        with pytest.raises(ValueError, match="--scheduling-policy priority"):
            fcfs.generate(["a"], SamplingParams(max_tokens=2), priority=[1])
        assert fcfs.engine.scheduler.requests == {}           # nothing was queued
    finally:
        fcfs.shutdown()
