"""A model step that fails because of one request fails that request alone: the
EngineCore re-runs the step on halves of its batch until the culprit is found
(EngineCore._isolate_failure); the others continue with the tokens they would
have produced anyway. The fault is injected by a wrapping executor passed in."""
import pytest

from formwork.core.engine_core import EngineCore
from formwork.core.step_hooks import StepHooks
from formwork.gpu.model_files import load_model_tokenizer
from formwork.gpu.executor import Executor
from formwork.schemas.config import EngineConfig
from formwork.schemas.engine import EngineCoreRequest, FinishReason
from formwork.schemas.sampling import SamplingParams
from formwork.schemas.scheduler import SchedulerOutput

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = {f"good{i}": [100 + 7 * i + j for j in range(5 + 3 * i)] for i in range(6)}
BAD_PROMPT = [4000 + j for j in range(20)]


class FaultyExecutor:
    """The real executor, but a step for which `fails(plan)` is true raises after the
    real forward and sampling ran (runner state updated, K/V slots written)."""

    def __init__(self, inner: Executor, fails) -> None:
        self.inner, self.fails = inner, fails
        self._plan: SchedulerOutput | None = None
        self.num_faults = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute_model(self, plan, non_block=True):
        self._plan = plan
        return self.inner.execute_model(plan, non_block)

    def sample_tokens(self, *args):
        out = self.inner.sample_tokens(*args)
        if self.fails(self._plan):
            self.num_faults += 1
            raise RuntimeError("injected fault (test)")
        return out


def _fails_for_bad(at: str):
    """Faults every step that schedules request "bad": from its prefill, or only once
    it is decoding (3 outputs in)."""
    def fails(plan: SchedulerOutput) -> bool:
        if "bad" not in plan.num_scheduled_tokens:
            return False
        if at == "prefill":
            return True
        base = {r.req_id: r.num_computed_tokens for r in plan.new_reqs + plan.cached_reqs}
        return base["bad"] >= len(BAD_PROMPT) + 2
    return fails


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
                          block_size=16, max_num_batched_tokens=256, max_num_seqs=8)
    executor = Executor(config, tiny_model_dir)
    yield config, executor, load_model_tokenizer(str(tiny_model_dir))
    executor.shutdown()


def _engine(parts, fails) -> tuple[EngineCore, FaultyExecutor]:
    config, executor, tokenizer = parts
    faulty = FaultyExecutor(executor, fails)
    engine = EngineCore(config, executor=faulty, tokenizer=tokenizer,
                        hooks=StepHooks(check_invariants=True))
    return engine, faulty


def _run(engine: EngineCore, prompts: dict[str, list[int]]) -> dict:
    for rid, ids in prompts.items():
        engine.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=ids,
                                             sampling_params=GREEDY))
    tokens = {rid: [] for rid in prompts}
    finals = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step().outputs:
            tokens[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                finals[o.request_id] = o
    assert not engine.has_unfinished_requests()
    return {rid: (tokens[rid], finals[rid]) for rid in prompts}


def _assert_idle(engine: EngineCore) -> None:
    engine.scheduler.check_invariants()
    kv = engine.kv_manager
    assert kv.num_free_blocks + kv.num_cached_blocks == kv.num_blocks


@pytest.mark.parametrize("at", ["prefill", "decode"])
def test_failing_request_fails_alone_others_unchanged(parts, at):
    engine, faulty = _engine(parts, lambda plan: False)
    alone = {rid: _run(engine, {rid: ids})[rid][0] for rid, ids in PROMPTS.items()}
    engine, faulty = _engine(parts, _fails_for_bad(at))     # fresh engine: no prefix-cache hits
    res = _run(engine, {**PROMPTS, "bad": BAD_PROMPT})
    bad_tokens, bad = res["bad"]
    assert bad.finish_reason == FinishReason.ERROR
    assert bad.error == "internal error in model step: injected fault (test)"
    assert len(bad_tokens) == (0 if at == "prefill" else 3)   # nothing from a failed step
    for rid in PROMPTS:
        tokens, final = res[rid]
        assert final.finish_reason == FinishReason.LENGTH and final.error is None, rid
        assert tokens == alone[rid], rid
    assert faulty.num_faults >= 2                 # the batch, then the bisection down to "bad"
    _assert_idle(engine)
    # the engine keeps serving, and from the prefix cache the same tokens come back
    again = _run(engine, dict(PROMPTS))
    assert {rid: t for rid, (t, _) in again.items()} == alone
    _assert_idle(engine)


def test_two_culprits_and_a_one_request_step(parts):
    bad = {"bad", "bad2"}
    engine, faulty = _engine(parts, lambda plan: bool(bad & set(plan.num_scheduled_tokens)))
    res = _run(engine, {**PROMPTS, "bad": BAD_PROMPT, "bad2": BAD_PROMPT[::-1]})
    assert {rid for rid, (_, f) in res.items() if f.finish_reason == FinishReason.ERROR} == bad
    _assert_idle(engine)
    res = _run(engine, {"bad": BAD_PROMPT})       # alone: its own culprit, no retry
    assert res["bad"][1].finish_reason == FinishReason.ERROR
    _assert_idle(engine)
