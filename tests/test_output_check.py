"""Re-validation of finished constrained outputs (gateway/output_check.py) and the
metrics that count it, with vLLM's metric names beside formwork's (gateway/metrics.py)."""
from __future__ import annotations

import json

import pytest

from formwork.gateway import output_check
from formwork.gateway.metrics import Metrics, RequestTimer
from formwork.gateway.output_check import check_output, drop_unset
from formwork.gateway.tools import ToolMode, tool_constraint
from formwork.schemas.engine import EngineStats
from formwork.schemas.openai import FunctionDefinition
from formwork.schemas.structured import StructuredOutputsParams as P

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


def _valid(params, text, finish="stop", stop_reason=None, mode=None):
    v = check_output(params, mode, text, finish, stop_reason)
    return None if v is None else (v.valid, v.error)


@pytest.mark.parametrize("params, text, valid", [
    (P(json=SCHEMA), '{"name": "Ann", "age": 3}', True),
    (P(json=SCHEMA), '{"name": "Annabel", "age": 3}', False),         # maxLength
    (P(json=SCHEMA), '{"name": "Ann"}', False),                       # required
    (P(json=SCHEMA), '{"name": "Ann", "age": 3', False),              # not JSON
    (P(json={"type": "string", "format": "date"}), '"2024-02-30"', False),   # formats checked
    (P(json={"type": "string", "format": "date"}), '"2024-02-29"', True),
    # these checkers come from jsonschema[format-nongpl], a dependency: without it
    # jsonschema passes any string for date-time and uri
    (P(json={"type": "string", "format": "date-time"}), '"2021-02-29T00:00:00Z"', False),
    (P(json={"type": "string", "format": "date-time"}), '"2024-02-29T10:00:00Z"', True),
    (P(json={"type": "string", "format": "uri"}), '"not a uri"', False),
    (P(json={"type": "string", "format": "iri"}), '"https://example.com/a"', True),  # URI first
    (P(json={"type": "string", "format": "iri"}), '"https://example.com/\u00e4"', True),
    (P(json={"type": "string", "format": "iri"}), '"not an iri"', False),
    (P(json={"$schema": "http://json-schema.org/draft-07/schema#",
             "items": [{"type": "integer"}]}), '["x"]', False),        # draft-07 tuple items
    (P(json_object=True), '{"a": [1]}', True),
    (P(json_object=True), '[1]', False),
    (P(regex=r"[a-z]+\d"), "abc1", True),
    (P(regex=r"[a-z]+\d"), "abc1 ", False),                           # fullmatch
    (P(choice=["yes", "no"]), "no", True),
    (P(choice=["yes", "no"]), "nope", False),
    (P(regex=r"a(?<=\w+)b"), "ab", None),           # Python's re cannot compile it: unchecked
    (P(grammar='root ::= "a"'), "a", None),
])
def test_kinds(params, text, valid):
    assert _valid(params, text)[0] is valid


def test_unconstrained_and_aborted_have_no_verdict():
    assert check_output(None, None, "x", "stop", None) is None
    assert check_output(P(json=SCHEMA), None, "{", "abort", None) is None


def test_cuts_say_why():
    valid, error = _valid(P(json=SCHEMA), '{"name": "A', finish="length")
    assert valid is False and error.startswith("cut by max_tokens (finish_reason length)")
    valid, error = _valid(P(json=SCHEMA), '{"name": "A', stop_reason="END")
    assert valid is False and "stop string 'END'" in error
    # a cut that happens to leave a complete document is valid (budget-aware decoding)
    assert _valid(P(json=SCHEMA), '{"name": "A", "age": 1}', finish="length") == (True, None)
    assert _valid(P(json=SCHEMA), "{}", finish="error")[0] is False


def test_error_names_the_path():
    _, error = _valid(P(json=SCHEMA), '{"name": "Ann", "age": "x"}')
    assert error.startswith("$.age:")


WEATHER = FunctionDefinition(name="weather", parameters={
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


def test_tool_calls_auto_validate_each_call_against_its_tool():
    mode = ToolMode("auto", (WEATHER,))
    params = tool_constraint(mode)
    good = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "weather", "arguments": {"town": "Paris"}}\n</tool_call>'
    assert _valid(params, good, mode=mode) == (True, None)
    valid, error = _valid(params, bad, mode=mode)
    assert valid is False and error.startswith("tool_calls[0] (weather) arguments: $:")
    assert _valid(params, "just text", mode=mode) == (True, None)
    assert _valid(params, "<tool_call> {oops", mode=mode)[0] is False


def test_tool_calls_auto_with_answer_format_checks_the_answer():
    mode = ToolMode("auto", (WEATHER,))
    params = tool_constraint(mode, P(json=SCHEMA))
    assert _valid(params, '{"name": "Ann", "age": 3}', mode=mode) == (True, None)
    assert _valid(params, '{"name": "Ann"}', mode=mode)[0] is False


def test_tool_calls_required_and_named_are_schemas():
    mode = ToolMode("required", (WEATHER,), parallel=True)
    params = tool_constraint(mode)
    ok = json.dumps([{"name": "weather", "arguments": {"city": "Oslo"}}])
    assert _valid(params, ok, mode=mode) == (True, None)
    assert _valid(params, json.dumps([{"name": "weather", "arguments": {}}]), mode=mode)[0] is False
    named = ToolMode("named", (WEATHER,), "weather")
    assert _valid(tool_constraint(named), '{"city": 1}', mode=named)[0] is False


def test_validators_are_compiled_once_per_schema():
    output_check._validator.cache_clear()
    for _ in range(5):
        check_output(P(json=SCHEMA), None, '{"name": "A", "age": 1}', "stop", None)
    info = output_check._validator.cache_info()
    assert info.misses == 1 and info.hits == 4
    assert info.maxsize == output_check._VALIDATOR_CACHE_SIZE


def test_drop_unset_keeps_verdicts_only():
    choices = [{"index": 0, "formwork": None}, {"index": 1, "formwork": {"valid": True}}]
    assert drop_unset(choices) == [{"index": 0}, {"index": 1, "formwork": {"valid": True}}]


# ---- metrics ----------------------------------------------------------------------------

def _samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_metrics_render_vllm_names_and_constrained_results():
    m = Metrics("smol")
    timer = RequestTimer()
    timer.on_tokens(3)
    m.observe_finished(timer, 7, ["stop", "length"])
    m.observe_constrained("valid")
    m.observe_constrained("invalid")
    m.observe_constrained("invalid")
    stats = EngineStats(num_running=2, num_waiting=1, num_waiting_for_grammar=1,
                        kv_total_blocks=100, kv_free_blocks=75, kv_cached_blocks=5,
                        prefix_cache_queries=40, prefix_cache_hits=16, num_preemptions=3,
                        grammar_compiles=0, grammar_cache_hits=0, grammar_compile_seconds=0.0,
                        bitmask_seconds=0.0, steps=1)
    s = _samples(m.render(stats).decode())
    lab = '{model_name="smol"}'
    assert (s[f"vllm:prefix_cache_queries_total{lab}"], s[f"vllm:prefix_cache_hits_total{lab}"],
            s[f"vllm:num_preemptions_total{lab}"]) == (40, 16, 3)
    assert s[f"vllm:num_requests_running{lab}"] == 2
    assert s[f"vllm:num_requests_waiting{lab}"] == 2          # incl. waiting for a grammar
    assert s[f"vllm:kv_cache_usage_perc{lab}"] == s[f"vllm:gpu_cache_usage_perc{lab}"] == 0.25
    assert s[f"vllm:prompt_tokens_total{lab}"] == 7
    assert s[f"vllm:generation_tokens_total{lab}"] == 3
    assert s['vllm:request_success_total{finished_reason="length",model_name="smol"}'] == 1
    assert s[f"vllm:time_to_first_token_seconds_count{lab}"] == 1
    assert s[f"vllm:e2e_request_latency_seconds_count{lab}"] == 1
    assert s['formwork_constrained_outputs_total{model_name="smol",result="invalid"}'] == 2
    assert s['formwork_constrained_outputs_total{model_name="smol",result="valid"}'] == 1
    assert s["formwork_prompt_tokens_total" + lab] == 7        # formwork's names stay


def test_the_iri_checker_loads_on_first_use_and_checks_as_before():
    """rfc3987_syntax builds 38 Lark grammars at import (~1-3 s of every process that
    imports jsonschema): formwork defers it until an IRI is checked. In a fresh
    interpreter: importing the gateway's checker leaves it (and lark) unloaded; the
    first IRI check loads the real package and checks with it."""
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent("""
        import sys
        from formwork.gateway import output_check
        import jsonschema
        from formwork.schemas.structured import StructuredOutputsParams as P
        assert "lark" not in sys.modules, "the IRI grammars were built at import"
        iri = P(json={"type": "string", "format": "iri"})
        check = output_check.check_output
        verdicts = [check(iri, None, t, "stop", None).valid
                    for t in ('"https://example.com/\\u00e4"', '"not an iri"')]
        ref = "iri-reference"
        fc = jsonschema.Draft202012Validator.FORMAT_CHECKER
        verdicts += [fc.conforms("//ex.com/\\u00e4", ref), fc.conforms("a b", ref)]
        assert "lark" in sys.modules and type(sys.modules["rfc3987_syntax"]).__name__ == "module"
        import rfc3987_syntax
        verdicts.append(rfc3987_syntax.is_valid_syntax_iri("http://a"))
        print(verdicts)
    """)
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["[True,", "False,", "True,", "False,", "True]"], proc.stdout


EVIL = "(a|aa)+b"                  # Python's re: ~1.6x the time per extra 'a'


@pytest.mark.parametrize("params, text", [
    (P(regex=EVIL), "a" * 60),
    (P(json={"type": "string", "pattern": f"^{EVIL}$"}), json.dumps("a" * 60)),
    (P(json={"type": "object", "patternProperties": {f"^{EVIL}$": {"type": "integer"}}}),
     json.dumps({"a" * 60: 1})),
    (P(json={"type": "object", "patternProperties": {f"^{EVIL}$": {"type": "integer"}},
             "additionalProperties": False}), json.dumps({"a" * 60: 1})),
])
def test_a_backtracking_pattern_is_left_unchecked_in_bounded_time(params, text):
    """The check runs on the event loop: Python's re took 18 s for 40 a's under
    `(a|aa)+b` (every other request of the server froze) and would take hours for 60.
    Now each match stops at REGEX_TIMEOUT_S, the choice is unchecked, and the
    pattern is remembered: the next check of it costs nothing."""
    import time

    output_check._slow_patterns.clear()
    start = time.perf_counter()
    valid, error = _valid(params, text, finish="length")
    assert time.perf_counter() - start < 30      # (bounded; re alone: hours)
    assert valid is None and "took longer than" in error and "backtracking" in error
    valid, error = _valid(params, text, finish="length")
    assert valid is None and "on an earlier check" in error                # remembered


@pytest.mark.parametrize("params, text, valid", [
    (P(regex=EVIL), "aaab", True),
    (P(regex=EVIL), "aaa", False),
    (P(regex=r"\d+\.\d*"), "3.", True),
    (P(regex="a$"), "a\n", False),            # fullmatch, as before
    (P(json={"type": "string", "pattern": "b"}), '"abc"', True),          # search, as before
    (P(json={"type": "string", "pattern": "^b"}), '"abc"', False),
    (P(json={"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
             "additionalProperties": False}), '{"x_a": 1}', True),
    (P(json={"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
             "additionalProperties": False}), '{"x_a": "1"}', False),
    (P(json={"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
             "additionalProperties": False}), '{"y": 1}', False),
    (P(json={"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
             "additionalProperties": {"type": "string"}}), '{"y": "s", "x_b": 2}', True),
    (P(json={"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
             "additionalProperties": {"type": "string"}}), '{"y": 1}', False),
    (P(json={"type": "object", "properties": {"y": {}}, "additionalProperties": False}),
     '{"y": 1, "z": 2}', False),
])
def test_bounded_matching_keeps_res_semantics(params, text, valid):
    output_check._slow_patterns.clear()
    assert _valid(params, text)[0] is valid


@pytest.mark.parametrize("params, text, valid", [
    # the regex package reads \w with combining marks (U+0E38) and \d, \s a little
    # differently from `re`: the check keeps `re`'s reading
    (P(regex=r"\W"), "\u0e38", True), (P(regex=r"\w"), "\u0e38", False),
    (P(regex=r"\w"), "\u00b2", True), (P(regex=r"[^\w]"), "\u0e38", True),
    (P(regex=r"a\b."), "a\u0e38", True), (P(regex=r"a\B."), "a\u0e38", False),
    (P(regex=r"\s"), "\x1c", True), (P(regex=r"[\d-]+"), "1-2", True),
    (P(json={"type": "string", "pattern": r"^\W$"}), '"\u0e38"', True),
    (P(regex=r"(?a)\w"), "\u00e9", None),              # ASCII flag: unchecked
])
def test_classes_keep_res_reading(params, text, valid):
    import re

    output_check._slow_patterns.clear()
    assert _valid(params, text)[0] is valid
    if params.regex and valid is not None:
        assert bool(re.fullmatch(params.regex, text)) is valid


def test_many_slow_patterns_share_one_budget():
    """Distinct patterns each just under the per-match timeout: the choice's check
    stops at CHECK_REGEX_BUDGET_S in all (unchecked), not after every one of them."""
    output_check._slow_patterns.clear()
    # 400 distinct patterns that match "a" * 23 slowly: ~7 ms each here (3 s in all), far
    # under the per-match timeout even on a box several times slower
    slow = [f"^(?:(a|aa)+b{i}|a*)$" for i in range(400)]
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": p}
                                               for i, p in enumerate(slow)}}
    doc = json.dumps({f"p{i}": "a" * 23 for i in range(len(slow))})
    valid, error = _valid(P(json=schema), doc)
    assert valid is None and f"longer than {output_check.CHECK_REGEX_BUDGET_S} s in all" in error
