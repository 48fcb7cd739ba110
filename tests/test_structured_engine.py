"""Structured outputs through the engine: the bitmask is filled while the
forward runs, slow or broken grammars fail or wait alone, and (real model)
every constrained output that finishes with "stop" validates."""
import json
import re
import threading
import time

import jsonschema
import pytest

from formwork import LLM, SamplingParams, StructuredOutputsParams as SO
from formwork.core.step_hooks import StepHooks
from formwork.schemas.engine import EngineCoreRequest, FinishReason

TINY_HOOKS = StepHooks(check_invariants=True)     # the `tiny` fixture's engine's
SIMPLE = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), engine_process=False, dtype="float32", num_kv_blocks=128,
              step_hooks=TINY_HOOKS)
    yield llm
    llm.shutdown()


def drain(eng, timeout_s=120):
    """Steps until every request has finished. Bounded by time, not by steps: a step
    waiting on a grammar compile returns at once, and a first compile (cold backend,
    the module run alone) outlasted 500 such steps."""
    outs, deadline = [], time.monotonic() + timeout_s
    while eng.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests still unfinished"
        outs += eng.step().outputs
    return outs


def test_bitmask_fill_overlaps_the_forward(tiny):
    """The fill runs on the engine thread while the forward (slowed to 30 ms
    here so the interval is measurable) runs on the worker thread."""
    eng = tiny.engine
    runner = eng.executor.runner
    real = runner.execute_model
    forward_threads = set()

    def slow_forward(plan):
        forward_threads.add(threading.get_ident())
        time.sleep(0.03)
        return real(plan)

    runner.execute_model = slow_forward
    fills = []
    real_fill = eng.structured.fill_bitmask

    def traced_fill(ids):
        t0 = time.perf_counter()
        mask = real_fill(ids)
        fills.append((t0, time.perf_counter(), threading.get_ident()))
        return mask

    eng.structured.fill_bitmask = traced_fill
    step_timings: list[dict] = []
    TINY_HOOKS.on_timing = step_timings.append
    try:
        eng.add_request(EngineCoreRequest(
            request_id="ov", prompt_token_ids=[1, 2, 3],
            # top_p: a request whose mask is never deferred (tests/test_deferred_masks.py)
            sampling_params=SamplingParams(temperature=0.7, top_p=0.9, seed=0, max_tokens=6,
                                           structured_outputs=SO(json=SIMPLE))))
        timings = []
        while eng.has_unfinished_requests():
            n_fills = len(fills)
            eng.step()
            if len(fills) > n_fills:          # this step filled a bitmask
                timings.append(step_timings[-1])
    finally:
        TINY_HOOKS.on_timing = None
        runner.execute_model = real
        del eng.structured.fill_bitmask
    assert fills and timings
    for t in timings:
        # launched first, filled meanwhile, done before the forward is: it adds no step time
        assert t["submitted"] <= t["fill_start"] and t["fill_end"] <= t["forward_end"], t
    assert all(tid != fills[0][2] for tid in forward_threads)   # two threads really


def test_slow_compile_does_not_delay_other_requests(tiny, monkeypatch):
    """A compile held back until the other request has finished: the other one
    runs to completion meanwhile (no timing assumptions)."""
    eng = tiny.engine
    mgr = eng.structured
    real_compile = mgr._compile
    release = threading.Event()
    slow_schema = {"type": "object", "properties": {"slow": {"type": "integer"}}, "required": ["slow"]}

    def compile_maybe_slow(params):
        if "slow" in json.dumps(params.spec()):
            assert release.wait(60), "test never released the compile"
        return real_compile(params)

    monkeypatch.setattr(mgr, "_compile", compile_maybe_slow)
    sp_slow = SamplingParams(temperature=0, max_tokens=8, structured_outputs=SO(json=slow_schema))
    eng.add_request(EngineCoreRequest(request_id="slow", prompt_token_ids=[5, 6], sampling_params=sp_slow))
    eng.add_request(EngineCoreRequest(request_id="fast", prompt_token_ids=[7, 8],
                                      sampling_params=SamplingParams(temperature=0, max_tokens=5,
                                                                     ignore_eos=True)))
    fast_tokens, slow_tokens, steps = [], [], 0
    while eng.has_unfinished_requests():
        for o in eng.step().outputs:
            (fast_tokens if o.request_id == "fast" else slow_tokens).extend(o.new_token_ids)
            if o.request_id == "fast" and o.finished:
                assert not slow_tokens and eng.scheduler.num_waiting_for_grammar == 1
                release.set()
        steps += 1
        assert steps < 5000
        time.sleep(0.001)
    assert len(fast_tokens) == 5 and release.is_set() and slow_tokens


def test_grammar_failure_fails_only_that_request(tiny, monkeypatch):
    eng = tiny.engine
    mgr = eng.structured
    real_compile = mgr._compile

    def broken(params):
        if params.kind() == "regex":
            raise RuntimeError("backend exploded")
        return real_compile(params)

    monkeypatch.setattr(mgr, "_compile", broken)
    eng.add_request(EngineCoreRequest(request_id="bad", prompt_token_ids=[5, 6], sampling_params=SamplingParams(
        temperature=0, max_tokens=4, structured_outputs=SO(regex="[0-9]+"))))
    eng.add_request(EngineCoreRequest(request_id="good", prompt_token_ids=[5, 6], sampling_params=SamplingParams(
        temperature=0, max_tokens=4, structured_outputs=SO(json=SIMPLE))))
    outs = drain(eng)
    bad = [o for o in outs if o.request_id == "bad"]
    good = [o for o in outs if o.request_id == "good"]
    assert bad[-1].finish_reason == FinishReason.ERROR and "exploded" in bad[-1].error
    assert not any(o.new_token_ids for o in bad)
    assert good[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    kv = eng.kv_manager
    assert kv.num_free_blocks + kv.num_cached_blocks == kv.num_blocks


# --------------------------------------------------------------------------- real model
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Rome"]},
                                      "population_millions": {"type": "number"}},
     "required": ["city"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "boolean"},
                                      "reason": {"type": "string", "maxLength": 40}},
     "required": ["answer", "reason"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"],
        "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
]
REGEXES = [r"\d{3}-\d{4}", r"(yes|no), because [a-z ]{1,20}\.", r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}"]
CHOICES = [["positive", "negative", "neutral"], ["Paris", "Berlin"]]
GRAMMAR = r'''root ::= "The answer is " num "."
num ::= [1-9] [0-9]?'''


def _chat(q):
    return [{"role": "user", "content": q}]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "llguidance", "xgrammar", "outlines"])
def test_real_model_constrained_outputs_validate(backend):
    llm = LLM(num_kv_blocks=512)
    convs, specs, checks = [], [], []
    for s in SCHEMAS:
        convs.append(_chat(f"Reply with JSON matching this schema: {json.dumps(s)}"))
        specs.append(SO(json=s, backend=backend))
        checks.append(lambda text, s=s: jsonschema.validate(json.loads(text), s))
    if backend != "outlines":      # outlines refuses json_object up front (tested in test_grammar_*)
        convs.append(_chat("Give me any JSON object describing a cat."))
        specs.append(SO(json_object=True, backend=backend))
        checks.append(lambda text: isinstance(json.loads(text), dict) or pytest.fail(text))
    for r in REGEXES:
        convs.append(_chat(f"Answer in the format {r}"))
        specs.append(SO(regex=r, backend=backend))
        checks.append(lambda text, r=r: re.fullmatch(r, text) or pytest.fail(f"{text!r} !~ {r}"))
    for c in CHOICES:
        convs.append(_chat(f"Pick one of {c}."))
        specs.append(SO(choice=c, backend=backend))
        checks.append(lambda text, c=c: text in c or pytest.fail(f"{text!r} not in {c}"))
    if backend != "outlines":
        convs.append(_chat("What is 6 times 7?"))
        specs.append(SO(grammar=GRAMMAR, backend=backend))
        checks.append(lambda text: re.fullmatch(r"The answer is [1-9][0-9]?\.", text) or pytest.fail(text))
    from formwork.grammar.selection import validate_params
    kept = []
    for i, spec in enumerate(specs):
        try:
            validate_params(spec)
            kept.append(i)
        except ValueError as e:      # rejected up front, naming the keyword: never silently loosened
            assert backend == "outlines" and "unsupported JSON Schema keyword 'minimum'" in str(e), e
    assert len(kept) >= len(specs) - 2
    convs, specs, checks = ([x[i] for i in kept] for x in (convs, specs, checks))
    params = [SamplingParams(temperature=0, max_tokens=80, structured_outputs=s) for s in specs]
    outs = llm.chat(convs, params, use_tqdm=False)
    stopped = 0
    for o, check in zip(outs, checks):
        c = o.outputs[0]
        if c.finish_reason == "stop":
            check(c.text)
            stopped += 1
        else:      # cut at max_tokens, or closed before it by budget-aware decoding (JSON)
            assert c.finish_reason == "length" and len(c.token_ids) <= 80, (c.finish_reason, c.text)
            if len(c.token_ids) < 80:
                check(c.text)
                stopped += 1
    assert stopped >= len(outs) - 2          # the bounded constraints nearly all terminate
    stats = llm.get_stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_free_blocks == stats.kv_total_blocks
    llm.shutdown()


@pytest.mark.slow
def test_real_model_length_cut_reports_length():
    llm = LLM(num_kv_blocks=256)
    s = {"type": "object", "properties": {"story": {"type": "string", "minLength": 500}}, "required": ["story"]}
    out = llm.chat([_chat("Tell a story as JSON.")],
                   SamplingParams(temperature=0, max_tokens=20, structured_outputs=SO(json=s)),
                   use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 20
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)
    llm.shutdown()


def test_outlines_refuses_json_object_up_front():
    from formwork.grammar.selection import validate_params
    with pytest.raises(ValueError, match="json_object"):
        validate_params(SO(json_object=True, backend="outlines"))
    validate_params(SO(json_object=True))          # auto -> llguidance


def test_stop_strings_cut_constrained_output_and_say_so(tiny):
    """As vLLM: a stop string the client asked for cuts constrained output too; the
    output says which string cut it (stop_reason), while one the grammar ended has
    stop_reason None, so a cut output is never taken for a complete one."""
    sp = dict(temperature=0, max_tokens=12, structured_outputs=SO(json=SIMPLE))
    base = tiny.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(**sp), use_tqdm=False)[0].outputs[0]
    with_stop = tiny.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(stop=['"'], **sp),
                              use_tqdm=False)[0].outputs[0]
    assert '"' in base.text
    assert with_stop.text == base.text[:base.text.index('"')]
    assert with_stop.finish_reason == "stop" and with_stop.stop_reason == '"'
    assert base.stop_reason is None