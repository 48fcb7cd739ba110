"""Budget-aware constrained decoding (grammar/budget.py and grammar/closing_search.py through the manager): an
adversarial "model" that never closes a string still ends with a valid document."""
from __future__ import annotations

import json
import random
import time

import jsonschema
import pytest

from formwork.gateway.cli import build_parser, engine_config
from formwork.grammar.backend import Matcher, allocate_bitmask, allowed_token_ids
from formwork.grammar.budget import EARLY_MARGIN, PROBE_AT, SLACK, START_LIMIT
from formwork.grammar.closing_search import NODE_LIMIT, STUCK, ClosingSearch
from formwork.grammar.jump_forward import ForcedTextEncoder
from formwork.grammar.llguidance_backend import LLGuidanceMatcher
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


def _decode(manager, tokenizer, rid, params, budget, pick, guard=False, out=None):
    """Decode under the manager as the scheduler does (with `guard`, as
    core/token_commit commits: budget_guard before accept), the model's token being
    `pick(allowed ids)`: (text, finished by the grammar, steered, guarded picks).
    `out`: a list the output's token ids are appended to as they come."""
    manager.submit(rid, params, budget=budget)
    _ready(manager, rid)
    eos = tokenizer.eos_token_id
    out = [] if out is None else out
    terminated, guarded = False, 0
    while len(out) < budget and not terminated:
        allowed = allowed_token_ids(manager.fill_bitmask([rid]), 0, VOCAB)
        others = [t for t in allowed if t != eos]
        tok = pick(allowed, others) if others else eos
        if guard and (closer := manager.budget_guard(rid, tok)) is not None:
            tok, guarded = closer, guarded + 1
        assert manager.accept_tokens(rid, [tok])
        terminated = manager.is_terminated(rid)
        if tok != eos:
            out.append(tok)
        if not terminated:
            out += manager.jump_forward_tokens(rid)
    steered = manager.budget_closed(rid)
    manager.remove(rid)
    return tokenizer.decode(out[:budget]), terminated, steered, guarded


def _run(manager, tokenizer, rid, params, budget):
    """A model that always writes 'x' where it can: (text, finished by the grammar,
    steered)."""
    x = tokenizer.encode("x", add_special_tokens=False)[0]
    return _decode(manager, tokenizer, rid, params, budget,
                   lambda allowed, others: x if x in allowed else others[0])[:3]


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


def test_default_is_json_only(manager, tokenizer):
    """On by default for JSON (schemas, `json_object`, and structural tags: tool calls
    under tool_choice "auto"), off for regexes, choices and grammars."""
    _, _, steered = _run(manager, tokenizer, "regex", P(regex='"x*"'), 8)
    assert not steered
    text, terminated, steered = _run(manager, tokenizer, "object", P(json_object=True), 12)
    assert terminated and steered and isinstance(json.loads(text), dict), text


def test_closing_path_leaves_the_matcher_as_it_was(manager, tokenizer):
    compiled = manager._compile(P(json=SCHEMA))[0]       # noqa: SLF001 (a fresh matcher)
    matcher = compiled.new_matcher()
    assert matcher.accept_tokens(tokenizer.encode('{"a": "hello', add_special_tokens=False))
    search = ClosingSearch(manager.vocab, VOCAB, tokenizer.eos_token_id,
                           ForcedTextEncoder(tokenizer, manager.vocab))
    path = search.path(matcher, 30)
    assert path and not search.can_end(matcher)
    assert matcher.accept_tokens(path) and search.can_end(matcher)
    text = '{"a": "hello' + tokenizer.decode(path)
    jsonschema.validate(json.loads(text), SCHEMA)


def _counting(search):
    """Count the mask fills of `search` (one per state it looks at)."""
    calls = []
    real = search._mask                                   # noqa: SLF001

    def mask(matcher):
        calls.append(1)
        return real(matcher)
    search._mask = mask                                   # noqa: SLF001
    return calls


def test_a_failing_search_looks_at_each_state_once(manager, tokenizer, monkeypatch):
    """Twelve required long keys cannot close in 16 tokens: both closer orders fail,
    and the second finds the states the first already reached remembered (a mask
    fill per state at most once; without that it is about twice as many). The
    first-dive cut-off (next test) is off here so that the searches run."""
    monkeypatch.setattr(ClosingSearch, "_dive", lambda *a: ((), STUCK))
    props = {f"property_number_{k}_with_a_long_name": {"type": "string"} for k in range(12)}
    schema = {"type": "object", "properties": props, "required": list(props),
              "additionalProperties": False}
    compiled = manager._compile(P(json=schema))[0]        # noqa: SLF001
    matcher = compiled.new_matcher()
    assert matcher.accept_tokens(tokenizer.encode('{"property_number_0_with_a_long_name": "a',
                                                  add_special_tokens=False))
    encoder = ForcedTextEncoder(tokenizer, manager.vocab)
    fills = {}
    for which in ((0,), (1,), (0, 1)):
        search = ClosingSearch(manager.vocab, VOCAB, tokenizer.eos_token_id, encoder)
        search.orders = [search.orders[k] for k in which]
        fills[which] = _counting(search)
        assert search.path(matcher, 16) is None
    both = len(fills[0, 1])
    assert both < len(fills[0,]) + len(fills[1,]) and both <= NODE_LIMIT + 1
    rest = "".join(f', "{k}": "b"' for k in list(props)[1:]) + "}"    # state left as it was
    assert matcher.accept_tokens(tokenizer.encode('"' + rest, add_special_tokens=False))
    assert search.can_end(matcher)


def test_a_hopeless_search_stops_after_its_first_dive(manager, tokenizer, monkeypatch):
    """The same twelve keys in 16 tokens: the first dive has not ended after 24
    tokens, so no search runs (fewer mask fills than the search); a search that
    can succeed is not cut (its dive ends)."""
    props = {f"property_number_{k}_with_a_long_name": {"type": "string"} for k in range(12)}
    schema = {"type": "object", "properties": props, "required": list(props),
              "additionalProperties": False}
    matcher = manager._compile(P(json=schema))[0].new_matcher()    # noqa: SLF001
    assert matcher.accept_tokens(tokenizer.encode('{"property_number_0_with_a_long_name": "a',
                                                  add_special_tokens=False))
    encoder = ForcedTextEncoder(tokenizer, manager.vocab)
    search = ClosingSearch(manager.vocab, VOCAB, tokenizer.eos_token_id, encoder)
    fills = _counting(search)
    assert search.path(matcher, 16) is None
    monkeypatch.setattr(ClosingSearch, "_dive", lambda *a: ((), STUCK))
    full = ClosingSearch(manager.vocab, VOCAB, tokenizer.eos_token_id, encoder)
    full_fills = _counting(full)
    assert full.path(matcher, 16) is None
    assert len(fills) < len(full_fills)      # 7 vs 11 here; ~3x less time on storm schemas
    monkeypatch.undo()
    small = manager._compile(P(json=SCHEMA))[0].new_matcher()      # noqa: SLF001
    assert small.accept_tokens(tokenizer.encode('{"a": "x", "b": "', add_special_tokens=False))
    search = ClosingSearch(manager.vocab, VOCAB, tokenizer.eos_token_id, encoder)
    assert search.path(small, 12) is not None


@pytest.mark.parametrize("written", ['{"a": "hello', '{"a": "x", "b": "', '{"a": "x", "b": "y"'])
def test_remembered_states_change_no_path(manager, tokenizer, written):
    """Both orders sharing what they found = each order searched on its own, the
    shorter kept (the path is a function of the state, not of the sharing)."""
    compiled = manager._compile(P(json=SCHEMA))[0]        # noqa: SLF001
    matcher = compiled.new_matcher()
    assert matcher.accept_tokens(tokenizer.encode(written, add_special_tokens=False))
    encoder = ForcedTextEncoder(tokenizer, manager.vocab)
    shared = ClosingSearch(manager.vocab, VOCAB, tokenizer.eos_token_id, encoder)
    alone = []
    for order in shared.orders:
        search = ClosingSearch(manager.vocab, VOCAB, tokenizer.eos_token_id, encoder)
        search.orders = [order]
        alone.append(search.path(matcher, 20))
    assert all(p is not None for p in alone)
    assert shared.path(matcher, 20) == min(alone, key=len)


def test_a_request_whose_search_failed_is_not_searched_again(manager, tokenizer, monkeypatch):
    props = {f"property_number_{k}_with_a_long_name": {"type": "string"} for k in range(12)}
    schema = {"type": "object", "properties": props, "required": list(props),
              "additionalProperties": False}
    searched = []
    real = manager._closing.path                          # noqa: SLF001

    def path(matcher, limit, **kw):
        searched.append(limit)
        return real(matcher, limit, **kw)
    monkeypatch.setattr(manager._closing, "path", path)   # noqa: SLF001
    text, terminated, steered = _run(manager, tokenizer, "long", P(json=schema), 40)
    assert not terminated and not steered
    assert searched == [40]              # the first search (PROBE_AT), none after it
    searched.clear()
    _run(manager, tokenizer, "long-100", P(json=schema), 100)
    # a longer budget: the path from the document's start first (once per constraint),
    # then the probe, twice that path's length before the end (here: at once), no more
    start = manager._closing._start[P(json=schema).cache_key()]      # noqa: SLF001
    assert searched == [START_LIMIT, 100] and 2 * start + EARLY_MARGIN >= 100
    searched.clear()
    _run(manager, tokenizer, "long-100b", P(json=schema), 100)
    assert searched == [100]             # the start's length is remembered
    searched.clear()
    _run(manager, tokenizer, "short-100", P(json=SCHEMA), 100)
    assert searched[:2] == [START_LIMIT, PROBE_AT]    # a short document: probed at PROBE_AT
    searched.clear()
    one = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    _, terminated, _ = _run(manager, tokenizer, "short", P(json=one), 24)
    assert terminated and len(searched) >= 2 and searched[:2] == [24, 16]   # found: again


def test_a_path_longer_than_the_window_is_closed_in_time(manager, tokenizer):
    """Five fields need a ~33-token closing path: from inside a 16-token window it
    cannot be found in time; the first search, PROBE_AT tokens before the end,
    opens this request's window early enough."""
    flat = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
        "active": {"type": "boolean"}, "score": {"type": "number"},
        "tier": {"enum": ["gold", "silver", "bronze"]}},
        "required": ["name", "age", "active", "score", "tier"], "additionalProperties": False}
    text, terminated, steered = _run(manager, tokenizer, "flat", P(json=flat), 40)
    assert terminated and steered
    jsonschema.validate(json.loads(text), flat)


CODED = {"type": "object", "additionalProperties": False,
         "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{5}$"},
                        "summary": {"type": "string", "minLength": 30}},
         "required": ["id", "summary"]}


def _search(manager, tokenizer, schema, written):
    matcher = manager._compile(P(json=schema))[0].new_matcher()    # noqa: SLF001
    assert matcher.accept_tokens(tokenizer.encode(written, add_special_tokens=False))
    search = ClosingSearch(manager.vocab, VOCAB, tokenizer.eos_token_id,
                           ForcedTextEncoder(tokenizer, manager.vocab))
    return matcher, search


@pytest.mark.parametrize("written", ['{"id": "', '{"id": "ABC-12', '{"id": "ABC-12345", "summary": "So'])
def test_strings_that_repeat_a_mask_while_they_progress_are_closed(manager, tokenizer, written):
    """Counted digits and a minLength keep the same mask for several tokens: the
    search does not follow such a token (it cannot tell progress from free text),
    the first dive does, so these strings close too."""
    matcher, search = _search(manager, tokenizer, CODED, written)
    path = search.path(matcher, 80)
    assert path is not None and matcher.accept_tokens(path) and search.can_end(matcher)
    jsonschema.validate(json.loads(written + tokenizer.decode(path)), CODED)


@pytest.mark.parametrize(("prop", "written"), [
    ({"type": "string", "format": "date-time"}, '{"t": "2021-01-01T00:00:00.'),
    ({"type": "string", "format": "date-time"}, '{"t": "2021-01-01T00:00:00.00'),
    ({"type": "string", "format": "time"}, '{"t": "12:00:00.1'),
    ({"type": "string", "pattern": "^[0-9]+[a-z]$"}, '{"t": "12'),
    ({"type": "string", "format": "email"}, '{"t": "john'),
    ({"type": "string", "format": "email"}, '{"t": "john.'),
    ({"type": "string", "format": "uri"}, '{"t": "ht'),
])
def test_a_string_that_only_another_kind_of_byte_ends_is_closed(manager, tokenizer, prop,
                                                                 written):
    """Fractional seconds allow '0' for ever and end only with 'Z' or an offset; digits
    before a required letter the same: the dive took '0' until it gave up, so a
    date-time cut mid-seconds was not closed. An email's local part takes the closers
    '}' and '0' by turns and ends only with '@'; a uri's scheme ('0' and 'null') with ':'."""
    schema = {"type": "object", "properties": {"t": prop}, "required": ["t"]}
    matcher, search = _search(manager, tokenizer, schema, written)
    path = search.path(matcher, 24)
    assert path is not None and matcher.accept_tokens(path) and search.can_end(matcher)
    cls = jsonschema.validators.validator_for(schema)
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(
        json.loads(written + tokenizer.decode(path)))


def test_an_integer_does_not_take_zeros_for_ever(manager, tokenizer):
    """Inside an integer '0' is always allowed and comes before ',' among the
    closers: the token just taken is tried last, so the dive ends the number."""
    nested = {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
              "properties": {"id": {"type": "integer"},
                             "tags": {"type": "array", "items": {"type": "string"}}}}
    matcher, search = _search(manager, tokenizer, nested, '{"id": 12')
    dive, verdict = search._dive(matcher, 32, search.orders[0], {})  # noqa: SLF001
    assert verdict == "ends" and len(dive) < 16
    assert json.loads('{"id": 12' + tokenizer.decode(list(dive)))["id"] < 10**6


@pytest.mark.parametrize(("schema", "written"), [
    ({"type": "number", "multipleOf": 7}, "2022010100"),
    ({"type": "integer", "multipleOf": 13}, "123456789"),
    ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 7}},
      "required": ["n"], "additionalProperties": False}, '{"n": 100'),
    ({"type": "array", "items": {"type": "integer", "multipleOf": 11}}, "[3"),
])
def test_a_number_under_multiple_of_is_closed_by_its_next_digit(manager, tokenizer, schema,
                                                               written):
    """Under `multipleOf: 7` the closers' '0' after 2022010100 only multiplies by ten
    and never reaches a multiple: the dive wrote zeros until it gave up, and outputs
    of 128 digits were cut invalid. One digit always reaches one (10n + d covers
    every residue): the path is that digit and what closes around it."""
    matcher, search = _search(manager, tokenizer, schema, written)
    path = search.path(matcher, 4)
    assert path is not None and matcher.accept_tokens(path) and search.can_end(matcher)
    jsonschema.validate(json.loads(written + tokenizer.decode(path)), schema)


def test_a_dive_through_patterned_items_asks_few_masks(manager, tokenizer):
    """Sixty patterned strings cannot close in 24 tokens: the dive finds that
    (LONG) asking the matcher about single tokens, with a mask only where a new
    kind of character first comes (not once per character or item)."""
    items = {"type": "array", "minItems": 60,
             "items": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"}}
    matcher, search = _search(manager, tokenizer, items, '["AB-1234", "C')
    fills = _counting(search)
    dive, verdict = search._dive(matcher, 48, search.orders[0], {})  # noqa: SLF001
    assert verdict == "long" and len(dive) > 48
    assert len(fills) <= 3, len(fills)
    assert search.path(matcher, 24) is None


class _CountingTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def encode(self, text, **kw):
        self.calls.append(text)
        return self.tokenizer.encode(text, **kw)


def test_forced_text_is_tokenized_once_per_text(manager, tokenizer):
    counting = _CountingTokenizer(tokenizer)
    encoder = ForcedTextEncoder(counting, manager.vocab, max_entries=2)
    first = encoder.ids('","name":"')
    assert encoder.ids('","name":"') == first and counting.calls == ['","name":"']
    # the last token is kept only if no longer token could extend it
    spelled = b"".join(manager.vocab.token_bytes[t] for t in first)
    assert '","name":"'.encode().startswith(spelled) and first
    encoder.ids("a")
    encoder.ids("b")                                      # full: emptied, then "b" kept
    encoder.ids('","name":"')
    assert counting.calls.count('","name":"') == 2


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


RECORDS = {"type": "object", "required": ["items"], "properties": {"items": {
    "type": "array", "items": {"type": "object", "required": ["a", "b"],
                               "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}}}}


def _run_extender(manager, tokenizer, rid, budget, guard=True, schema=RECORDS):
    """Committed as core/token_commit does, with a model that ends each string at
    once and opens another list element wherever it can ('"', then '},', '{', ',';
    else the first allowed token): (text, finished by the grammar, guarded picks)."""
    enc = [tokenizer.encode(t, add_special_tokens=False) for t in ('"', "},", "{", ",")]
    prefer = [ids[0] for ids in enc if len(ids) == 1]
    text, terminated, _, guarded = _decode(
        manager, tokenizer, rid, P(json=schema), budget,
        lambda allowed, others: next((t for t in prefer if t in allowed), others[0]), guard)
    return text, terminated, guarded


@pytest.mark.parametrize("budget", [28, 40, 56])
def test_a_pick_that_opens_what_cannot_close_in_time_is_replaced(manager, tokenizer, budget):
    """A list of records whose model keeps opening elements: near the end, a pick
    after which no closing path fits (a new element's two required fields) is replaced
    by the closing path's next token (or never reached: the guard keeps the path known,
    so steering closes in time), and the output closes valid. Without the guard the
    same model is cut inside an element."""
    text, terminated, _ = _run_extender(manager, tokenizer, f"ext-{budget}", budget)
    assert terminated, text
    doc = json.loads(text)
    jsonschema.validate(doc, RECORDS)
    assert len(doc["items"]) >= 1
    text, terminated, _ = _run_extender(manager, tokenizer, f"raw-{budget}", budget, guard=False)
    assert not terminated, text


def test_a_pick_with_a_path_after_it_is_kept_and_its_path_reused(manager, tokenizer,
                                                                 monkeypatch):
    """A pick that still leaves a closing path in the tokens left is committed as
    sampled, and the path searched for it serves the next step (no second search)."""
    rid = "keep"
    manager.submit(rid, P(json=RECORDS), budget=20)
    _ready(manager, rid)
    text = '{"items": [{"a": "x", "b": "y'
    ids = tokenizer.encode(text, add_special_tokens=False)
    manager.fill_bitmask([rid])              # the probe (at the start of a short request)
    for t in ids:
        assert manager.accept_tokens(rid, [t])
    entry = manager._requests[rid]                          # noqa: SLF001
    manager.fill_bitmask([rid])              # near the end: the path is searched
    budget = entry.budget
    assert budget.closing and budget.left <= budget.window
    x = tokenizer.encode("y", add_special_tokens=False)[0]  # string content: still closes
    assert x != budget.closing[0] and manager.budget_guard(rid, x) is None
    calls = []
    real = ClosingSearch.path
    monkeypatch.setattr(ClosingSearch, "path", lambda *a: calls.append(1) or real(*a))
    assert manager.accept_tokens(rid, [x])
    manager.fill_bitmask([rid])
    assert calls == [] and budget.closing, "the guard's path was searched again"
    assert manager.accept_tokens(rid, budget.closing)
    assert manager.is_terminated(rid) or manager._closing.can_end(entry.matcher)  # noqa: SLF001
    manager.remove(rid)


@pytest.mark.parametrize("schema", [RECORDS, {"type": "integer", "maximum": 500},
                                    {"type": "string", "minLength": 3, "maxLength": 6},
                                    {"enum": ["red", "green", 7, None]}])
def test_closes_with_agrees_with_accepting_and_asking(manager, tokenizer, schema):
    """llguidance's `closes_with` validates without consuming; along random walks it
    answers as the generic accept / ask-for-eos / roll back does, on closing paths,
    on a pick before them and on sequences cut short, and leaves the state alone."""
    rng = random.Random(3)
    bm = allocate_bitmask(1, VOCAB)
    eos = tokenizer.eos_token_id
    search = manager._closing                                       # noqa: SLF001
    compiled = manager._backend("llguidance").compile(P(json=schema))   # noqa: SLF001
    checked = ends = 0
    for _ in range(6):
        m = compiled.new_matcher()
        assert isinstance(m, LLGuidanceMatcher)
        for _ in range(24):
            m.fill_bitmask(bm, 0)
            allowed = [t for t in allowed_token_ids(bm, 0, VOCAB) if t != eos]
            if not allowed:
                break
            path = search.path(m, 16) or []
            pick = rng.choice(allowed)
            for seq in (path, [pick, *path], path[:-1], [pick]):
                fast = m.closes_with(seq, eos)
                assert fast == Matcher.closes_with(m, seq, eos), (seq, schema)
                checked, ends = checked + 1, ends + fast
            assert m.accept_tokens([pick])
    assert checked >= 24 and ends >= 6


PEOPLE = {"type": "object", "additionalProperties": False, "required": ["people", "date", "total"],
          "properties": {"people": {"type": "array", "items": {
              "type": "object", "required": ["name", "role", "email"],
              "properties": {"name": {"type": "string"}, "role": {"type": "string"},
                             "email": {"type": ["string", "null"], "format": "email"}}}},
                         "date": {"type": "string", "format": "date"},
                         "total": {"type": "number", "minimum": 0}}}


def test_a_search_from_inside_a_forced_key_starts_with_the_key(manager, tokenizer):
    """After a key's opening quote llguidance may allow only the whole name's token (no
    closer, no single byte): the search's first dive was stuck there and found nothing,
    so the guard replaced a harmless pick. The forced name now starts the path."""
    matcher, search = _search(manager, tokenizer, PEOPLE, '{"people": [{"name": "M", "')
    path = search.path(matcher, 60)
    assert path is not None and matcher.accept_tokens(path) and search.can_end(matcher)
    doc = json.loads('{"people": [{"name": "M", "' + tokenizer.decode(path))
    jsonschema.validate(doc, PEOPLE)


@pytest.mark.parametrize("left", range(24, 64, 2))
def test_a_refused_pick_is_replaced_by_the_shortest_paths_token(manager, tokenizer, left):
    """A path a pick kept without a search can be a longer one (`0"}]...` kept after
    `com` from the state after `example.`): a refused pick's replacement comes from a
    fresh search, `"}` and not a `0` that lets the email grow digits; whether another
    person cannot fit at all (the fewest tokens left here) or would leave the model
    fewer than ROOM tokens of its own (`formwork extract` at --max-tokens 150: a `0`
    after `mike@example.com`, and greedy SmolLM2 wrote 16 more)."""
    rid = f"fresh-{left}"
    manager.submit(rid, P(json=PEOPLE), budget=400)
    _ready(manager, rid)
    head = '{"people": [{"name": "M", "role": "CEO", "email": "mike@example.'
    assert manager.accept_tokens(rid, tokenizer.encode(head, add_special_tokens=False))
    entry = manager._requests[rid]                          # noqa: SLF001
    budget = entry.budget
    budget.left, budget.window, budget.probed, budget.probe_at = left, 64, True, 64
    manager.fill_bitmask([rid])
    assert budget.closing and tokenizer.decode(budget.closing[:1]) == "0"
    com = tokenizer.encode("com", add_special_tokens=False)
    assert len(com) == 1 and manager.budget_guard(rid, com[0]) is None
    assert manager.accept_tokens(rid, com)
    assert tokenizer.decode(budget.closing[:1]) == "0"      # kept: it still closes from here
    reopen = tokenizer.encode('"},', add_special_tokens=False)
    assert len(reopen) == 1                                  # another person
    closer = manager.budget_guard(rid, reopen[0])
    assert closer is None or tokenizer.decode([closer]).startswith('"'), left
    if left <= 30:
        assert closer is not None
    manager.remove(rid)


@pytest.mark.parametrize("budget", [46, 52, 70])
def test_the_window_opens_early_enough_to_refuse_a_new_record(manager, tokenizer, budget):
    """The window used to open 8 tokens before the probe's path length: a record
    opened just before it (a person's three fields, then the date and the total: ~49
    tokens) left no path once it opened, and the output was cut. It now opens at twice
    the path's length (+ 8), where such a pick is still refused."""
    text, terminated, _ = _run_extender(manager, tokenizer, f"win-{budget}", budget,
                                        schema=PEOPLE)
    assert terminated, text
    jsonschema.validate(json.loads(text), PEOPLE)


def test_a_dive_where_only_whole_key_tokens_are_allowed_goes_on(manager, tokenizer):
    """After `,"` with two names left that share a prefix (`formClasses`, `formId`),
    llguidance allowed no closer and no single byte, only whole-name tokens: the dive
    was stuck and no path was found from the document's start, so budget-aware
    decoding gave up (a Snowplow form schema, cut at 64 tokens). The shortest
    allowed tokens are followed there."""
    schema = {"type": "object", "additionalProperties": False, "required": ["formId"],
              "properties": {"elements": {"type": "array", "items": {"type": "string"}},
                             "formClasses": {"type": "array", "items": {"type": "string"}},
                             "formId": {"type": "string"}}}
    for written in ("", '{"elements":[],"'):
        matcher, search = _search(manager, tokenizer, schema, written)
        path = search.path(matcher, 64)
        assert path is not None, written
        jsonschema.validate(json.loads(written + tokenizer.decode(path)), schema)


# One call of a weather tool, as `tool_choice: "required"` constrains it (gateway/tools).
CALL = {"type": "array", "minItems": 1, "items": {"anyOf": [{
    "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
    "properties": {"name": {"const": "get_weather"}, "arguments": {
        "type": "object", "required": ["city", "unit"],
        "properties": {"city": {"type": "string"},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}]}}
# ... as SmolLM2 writes it, with spaces: 29 tokens with its eos
WRITTEN_CALL = '[\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n]'


def test_a_closing_path_is_spelled_in_the_tokenizers_own_tokens(manager, tokenizer):
    """The search builds a path from closers, single bytes and forced key names (`{`
    `"` `name` `"` `:` `"`: a call from its start in 29 tokens); the path it returns is
    that text as the tokenizer spells it (`{"` `name` `":"`: 21), never longer, and a
    string it must write is left empty rather than opened with a closer's byte
    (`"city": "}"` then `","`, as short in the search's pieces)."""
    matcher, search = _search(manager, tokenizer, CALL, "")
    path = search.path(matcher, 64)
    text = tokenizer.decode(path)
    assert len(path) <= len(tokenizer.encode(text, add_special_tokens=False)), text
    assert matcher.accept_tokens(path) and search.can_end(matcher)
    call = json.loads(text)
    jsonschema.validate(call, CALL)
    assert call[0]["arguments"]["city"] == ""
    matcher.rollback(len(path))
    # judged by its spelled length: a budget the search's own pieces exceed
    assert search.path(matcher, len(path)) == path


_PIECES: list[str] = []


def _pieces(tokenizer) -> list[str]:
    """Each token's text (decoded once per test run)."""
    if not _PIECES:
        _PIECES.extend(tokenizer.decode([t]) for t in range(VOCAB))
    return _PIECES


def _write(manager, tokenizer, rid, schema, target, budget, params=None):
    """A model that writes `target` (the longest allowed token that continues it, then
    the stop token), committed as core/token_commit does: (text, finished by the
    grammar, steered, guarded picks)."""
    out: list[int] = []
    piece = _pieces(tokenizer)

    def pick(allowed, others):
        done = tokenizer.decode(out)
        rest = target[len(done):] if target.startswith(done) else ""
        fits = [t for t in others if piece[t] and rest.startswith(piece[t])]
        if fits:
            return max(fits, key=lambda t: len(piece[t]))
        return tokenizer.eos_token_id if tokenizer.eos_token_id in allowed else others[0]
    return _decode(manager, tokenizer, rid, params or P(json=schema), budget, pick, guard=True,
                   out=out)


@pytest.mark.parametrize("extra", [0, 2, 8])
def test_an_output_that_fits_its_budget_is_written_as_the_model_writes_it(manager, tokenizer,
                                                                          extra):
    """A call the model writes in 28 tokens (29 with its eos) under a budget it fits:
    with SLACK tokens to spare no token is steered or replaced; with none, only the
    spaces of its last part go (steered onto the path). The path used to be measured
    in the search's pieces (29 tokens from the start): the call was steered from its
    second token on, its city came back `"}"`, and with 2 to spare it was steered too."""
    free = _write(manager, tokenizer, "free-call", CALL, WRITTEN_CALL, 400)
    assert free[:2] == (WRITTEN_CALL, True)
    n = len(tokenizer.encode(WRITTEN_CALL, add_special_tokens=False))
    text, terminated, steered, guarded = _write(manager, tokenizer, f"fit-{extra}", CALL,
                                                WRITTEN_CALL, n + 1 + extra)
    if extra >= SLACK:
        assert (text, terminated, steered, guarded) == (WRITTEN_CALL, True, False, 0)
    else:
        assert terminated and json.loads(text) == json.loads(WRITTEN_CALL)


def _auto_tools():
    from formwork.gateway.tools import ToolMode, tool_constraint
    from formwork.schemas.openai import FunctionDefinition
    fn = FunctionDefinition(name="get_weather",
                            parameters=CALL["items"]["anyOf"][0]["properties"]["arguments"])
    return tool_constraint(ToolMode("auto", (fn,)))


LONG_CITY = "Paris, the capital of France, on the Seine"
AUTO_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + LONG_CITY +
             '", "unit": "celsius"}}\n</tool_call>')


@pytest.mark.parametrize("budget", [12, 24, 36, 37, 44])
def test_a_tool_call_under_tool_choice_auto_is_closed_or_never_begun(manager, tokenizer,
                                                                     budget):
    """tool_choice "auto" (a structural tag: free text, `<tool_call>` then a call): a
    call cut at max_tokens was returned as its raw text in `content`. Now a call that
    can still close in the tokens left is closed (its argument shortened), and the
    token that would complete the trigger is refused where the call cannot close, or
    could only as placeholders (fewer than ROOM tokens of its own: `"city": ""`), so
    the output ends there, no call begun. Also under 16 tokens, where the request
    starts inside its window (the guard used to wait for a probe that never ran)."""
    params = _auto_tools()
    text, terminated, _, _ = _write(manager, tokenizer, f"auto-{budget}", None, AUTO_CALL,
                                    budget, params=params)
    assert terminated, text
    if "<tool_call>" not in text:
        assert budget < 37 and AUTO_CALL.startswith(text)
        return
    head, _, rest = text.partition("<tool_call>\n")
    body, end, tail = rest.partition("\n</tool_call>")
    assert head == "" and end and tail == "", text
    call = json.loads(body)
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], CALL["items"]["anyOf"][0]["properties"]["arguments"])
    assert call["arguments"]["city"] and LONG_CITY.startswith(call["arguments"]["city"])


INVOICE = {"type": "object", "additionalProperties": False,
           "required": ["invoice_number", "issue_date", "seller", "buyer", "line_items", "total",
                        "currency"],
           "properties": {
               "invoice_number": {"type": "string"},
               "issue_date": {"type": "string", "format": "date"},
               "due_date": {"type": ["string", "null"], "format": "date"},
               "seller": {"type": "string"}, "buyer": {"type": "string"},
               "line_items": {"type": "array", "minItems": 1, "items": {
                   "type": "object", "additionalProperties": False,
                   "required": ["description", "quantity", "unit_price"],
                   "properties": {"description": {"type": "string"},
                                  "quantity": {"type": "integer", "minimum": 1},
                                  "unit_price": {"type": "number", "minimum": 0}}}},
               "total": {"type": "number", "minimum": 0},
               "currency": {"type": "string", "pattern": "^[A-Z]{3}$"}}}


@pytest.mark.parametrize("budget", [120, 200, 512])
def test_a_document_longer_than_the_probe_closes_after_a_long_string(manager, tokenizer, budget):
    """An invoice's closing path from inside its first string needs more than PROBE_AT
    tokens (`formwork extract`: SmolLM2 wrote digits into the invoice number for 440 of
    512 tokens): the probe, PROBE_AT tokens before the end, found no path there and
    the record was cut. The probe now runs at twice the document's shortest form
    before the end, where the string can still be closed."""
    text, terminated, steered = _run(manager, tokenizer, f"inv-{budget}", P(json=INVOICE), budget)
    assert terminated and steered, text[-80:]
    doc = json.loads(text)
    jsonschema.validate(doc, INVOICE)
    assert doc["invoice_number"].startswith("xxxx")


OBJECT = ('{\n "capital": "Mumbai",\n "population": 12000000,\n'
          ' "landmarks": ["Gateway of India", "Marine Drive"]\n}')


def test_a_member_that_could_only_be_a_placeholder_is_not_opened(manager, tokenizer):
    """json_object, a model writing a three-member object under budgets too small for
    it: a pick that opens another member (`,`) while it still fits but leaves the
    model fewer than ROOM tokens of its own is refused, and the object closes where it
    is. It used to be opened and filled by the path (`"capital": "Mumbai","":""}`:
    an empty key, 5 of 16 budgets here)."""
    for budget in range(8, 40, 2):
        text, terminated, _, _ = _write(manager, tokenizer, f"obj-{budget}", None, OBJECT,
                                        budget, params=P(json_object=True))
        assert terminated and isinstance(json.loads(text), dict), text
        assert '"":' not in text, (budget, text)
