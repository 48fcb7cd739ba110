"""Budget-aware constrained decoding (grammar/budget.py through the manager): an
adversarial "model" that never closes a string still ends with a valid document."""
from __future__ import annotations

import json
import time

import jsonschema
import pytest

from formwork.gateway.cli import build_parser, engine_config
from formwork.grammar.backend import allowed_token_ids
from formwork.grammar.budget import ClosingSearch
from formwork.grammar.manager import StructuredOutputManager
from formwork.schemas.structured import StructuredOutputsParams as P

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {k: {"type": "string"} for k in "abcd"},
          "required": list("abcd"), "additionalProperties": False}


@pytest.fixture(scope="module")
def manager(tokenizer):
    m = StructuredOutputManager(tokenizer, VOCAB, compile_timeout_s=30.0)
    yield m
    m.shutdown()


def _ready(manager, rid):
    deadline = time.monotonic() + 30
    while manager.status(rid) == "pending" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert manager.status(rid) == "ready"


def _run(manager, tokenizer, rid, params, budget):
    """Decode under the manager as the scheduler does, with a model that always
    writes 'x' where it can: (text, finished by the grammar, steered)."""
    manager.submit(rid, params, budget=budget)
    _ready(manager, rid)
    x = tokenizer.encode("x", add_special_tokens=False)[0]
    eos = tokenizer.eos_token_id
    out: list[int] = []
    terminated = False
    while len(out) < budget and not terminated:
        allowed = allowed_token_ids(manager.fill_bitmask([rid]), 0, VOCAB)
        others = [t for t in allowed if t != eos]
        tok = x if x in allowed else (others[0] if others else eos)
        assert manager.accept_tokens(rid, [tok])
        terminated = manager.is_terminated(rid)
        if tok != eos:
            out.append(tok)
        if not terminated:
            out += manager.jump_forward_tokens(rid)
    steered = manager.budget_closed(rid)
    manager.remove(rid)
    return tokenizer.decode(out[:budget]), terminated, steered


@pytest.mark.parametrize("budget", [24, 32, 40])
def test_budget_aware_closes_a_schema_in_time(manager, tokenizer, budget):
    text, _, steered = _run(manager, tokenizer, f"on-{budget}", P(json=SCHEMA), budget)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert steered


def test_off_per_request_leaves_the_cut(manager, tokenizer):
    text, terminated, steered = _run(manager, tokenizer, "off",
                                     P(json=SCHEMA, budget_aware=False), 24)
    assert not terminated and not steered
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_default_is_json_schemas_only(manager, tokenizer):
    _, _, steered = _run(manager, tokenizer, "regex", P(regex='"x*"'), 8)
    assert not steered


def test_closing_path_leaves_the_matcher_as_it_was(manager, tokenizer):
    compiled = manager._compile(P(json=SCHEMA))[0]       # noqa: SLF001 (a fresh matcher)
    matcher = compiled.new_matcher()
    assert matcher.accept_tokens(tokenizer.encode('{"a": "hello', add_special_tokens=False))
    search = ClosingSearch(manager.vocab, VOCAB, tokenizer.eos_token_id, tokenizer)
    path = search.path(matcher, 30)
    assert path and not search.can_end(matcher)
    assert matcher.accept_tokens(path) and search.can_end(matcher)
    text = '{"a": "hello' + tokenizer.decode(path)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_server_flag_turns_the_default_off(tokenizer):
    parser = build_parser(["serve"])
    assert engine_config(parser.parse_args(["serve"])).budget_aware is True
    assert engine_config(parser.parse_args(["serve", "--no-budget-aware"])).budget_aware is False
    off = StructuredOutputManager(tokenizer, VOCAB, budget_aware=False)
    try:
        _, _, steered = _run(off, tokenizer, "flag-off", P(json=SCHEMA), 24)
        assert not steered
        _, _, steered = _run(off, tokenizer, "asked", P(json=SCHEMA, budget_aware=True), 24)
        assert steered                  # a request may still ask for it
    finally:
        off.shutdown()
