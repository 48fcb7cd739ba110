"""Conformance tests shared by the llguidance, xgrammar and outlines-core backends.

Random walks sample uniformly among the tokens the mask allows (seeded) until
the stop token or a step limit; every finished walk must validate against the
constraint by an independent reference (jsonschema, re.fullmatch, membership,
a recursive-descent parser for the EBNF).
"""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from formwork.grammar.backend import allocate_bitmask, allowed_mask, allowed_token_ids
from formwork.grammar.jump_forward import ForcedTextEncoder, forced_tokens
from formwork.grammar.llguidance_backend import LLGuidanceBackend
from formwork.grammar.outlines_backend import OutlinesBackend
from formwork.grammar.selection import choose_backend
from formwork.grammar.vocab import TokenVocab
from formwork.grammar.xgrammar_backend import XGrammarBackend
from formwork.schemas.structured import StructuredOutputsParams as P

VOCAB = 49152
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "tags": {"type": "array", "items": {"enum": ["a", "b c", "\u00e9"]}, "maxItems": 2},
    "ok": {"type": "boolean"}}, "required": ["name", "ok"], "additionalProperties": False}
REGEX = r"[a-c]{2,4}-\d{1,3}"
CHOICES = ["red", "blue sky", "blue sea", 'say "hi"\n']
EBNF = r"""root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")"
num ::= [0-9] | [1-9] [0-9]
"""


def parse_expr(text: str) -> bool:
    """Reference parser for EBNF above: True iff `text` is a full expression."""
    pos = 0

    def term() -> bool:
        nonlocal pos
        if text[pos:pos + 1] == "(":
            pos += 1
            if not expr() or text[pos:pos + 1] != ")":
                return False
            pos += 1
            return True
        m = re.match(r"[1-9][0-9]|[0-9]", text[pos:])
        if m is None:
            return False
        pos += m.end()
        return True

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while text[pos:pos + 1] in ("+", "-") and pos < len(text):
            pos += 1
            if not term():
                return False
        return True

    return expr() and pos == len(text)


def _json_ok(schema, max_ws):
    """Valid JSON for `schema` with whitespace runs (outside strings) <= max_ws."""
    def check(text):
        jsonschema.validate(json.loads(text), schema)
        outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
        assert not re.search(r"\s{%d}" % (max_ws + 1), outside), text
        return True
    return check


CASES = {
    "json-compact": (P(json=PERSON, whitespace="compact"), _json_ok(PERSON, 0)),
    "json-flexible": (P(json=PERSON, max_whitespace=2), _json_ok(PERSON, 2)),
    "regex": (P(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    "choice": (P(choice=CHOICES), lambda t: t in CHOICES),
    "grammar": (P(grammar=EBNF), parse_expr),
}
VALID = {"json-compact": ['{"name":"ab","tags":["b c"],"ok":true}', '{"name":"","ok":false}'],
         "json-flexible": ['{ "name": "ab",\n "ok" : true }'],
         "regex": ["ab-1", "cccc-999"], "choice": CHOICES, "grammar": ["1+(2-34)", "(7)"]}
INVALID = {"json-compact": ['{"name":"ab", "ok":true}', '{"name":"abcdefg","ok":true}',
                            '{"name":"a","ok":true,"x":1}', '{"name":"a\x1cb","ok":true}'],
           "json-flexible": ['{"name":   "ab","ok":true}', '{"name":"ab","ok":1}'],
           "regex": ["a-1", "ab-1234", "abd-1"], "choice": ["blue", "red "],
           "grammar": ["1+", "(1", "012", "1++2"]}
# All three backends fix object keys to the schema's order (stricter than the schema).
FIXED_ORDER = '{"ok":true,"name":"a"}'
BACKENDS = ("llguidance", "xgrammar", "outlines")
BACKEND_KINDS = [(b, k) for b in BACKENDS for k in CASES
                 if not (b == "outlines" and k == "grammar")]


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return TokenVocab.from_tokenizer(tokenizer, VOCAB)


@pytest.fixture(scope="module")
def backends(vocab, tokenizer):
    return {"llguidance": LLGuidanceBackend(vocab, tokenizer), "xgrammar": XGrammarBackend(vocab),
            "outlines": OutlinesBackend(vocab)}


@pytest.fixture(scope="module")
def compiled(backends):
    cache = {}

    def get(backend, kind):
        if (backend, kind) not in cache:
            cache[backend, kind] = backends[backend].compile(CASES[kind][0])
        return cache[backend, kind]
    return get


def accepts(matcher, tokenizer, vocab, text: str) -> bool:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (matcher.accept_tokens(ids) and matcher.accept_tokens([vocab.eos_token_id])
            and matcher.is_terminated())


def random_walk(matcher, vocab, rng, max_steps=150) -> tuple[str, bool]:
    eos, bitmask, out = vocab.eos_token_id, allocate_bitmask(1, VOCAB), []
    never = torch.tensor([b is None for b in vocab.token_bytes])    # special/padding ids
    never[eos] = False
    for _ in range(max_steps):
        matcher.fill_bitmask(bitmask, 0)
        allowed = allowed_mask(bitmask, 0, VOCAB)
        assert allowed.any() and not (allowed & never).any()
        stop_ok = bool(allowed[eos])
        allowed[eos] = False
        others = torch.nonzero(allowed).flatten()
        stop = stop_ok and (len(others) == 0 or rng.random() < 0.3)
        tok = eos if stop else int(others[rng.randrange(len(others))])
        assert matcher.accept_tokens([tok]), "a token the mask allowed was rejected"
        if stop:
            assert matcher.is_terminated()
            return b"".join(out).decode("utf-8"), True
        out.append(vocab.token_bytes[tok])
    return b"".join(out).decode("utf-8", "replace"), False


# outlines-core bounds each whitespace slot; two slots can touch ("[  ]"), so a
# run is bounded by twice the setting there (still finite: it cannot loop).
OUTLINES_CHECKS = {"json-flexible": _json_ok(PERSON, 4)}


@pytest.mark.parametrize("backend,kind", BACKEND_KINDS)
def test_random_walks_under_the_mask_validate(backend, kind, compiled, vocab):
    check = OUTLINES_CHECKS.get(kind, CASES[kind][1]) if backend == "outlines" else CASES[kind][1]
    finished = 0
    for seed in range(6):
        text, done = random_walk(compiled(backend, kind).new_matcher(), vocab, random.Random(seed))
        if done:
            assert check(text), f"{backend}/{kind} produced {text!r}"
            finished += 1
    assert finished >= 3


@pytest.mark.parametrize("backend,kind", BACKEND_KINDS)
def test_valid_accepted_invalid_rejected(backend, kind, compiled, tokenizer, vocab):
    g = compiled(backend, kind)
    for text in VALID[kind]:
        assert CASES[kind][1](text)
        assert accepts(g.new_matcher(), tokenizer, vocab, text), text
    for text in INVALID[kind]:
        assert not accepts(g.new_matcher(), tokenizer, vocab, text), text
    if kind == "json-compact":
        assert not accepts(g.new_matcher(), tokenizer, vocab, FIXED_ORDER)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollback_restores_masks_and_accept_is_atomic(backend, compiled, tokenizer, vocab):
    m = compiled(backend, "json-compact").new_matcher()
    ids = tokenizer.encode('{"name":"ab","ok":true}', add_special_tokens=False)
    masks = []
    for tid in ids:
        bm = allocate_bitmask(1, VOCAB)
        m.fill_bitmask(bm, 0)
        masks.append(bm)
        assert m.accept_tokens([tid])
    assert m.accept_tokens([vocab.eos_token_id]) and m.is_terminated()
    m.rollback(3)                                   # the stop token and two more
    assert not m.is_terminated()
    bm = allocate_bitmask(1, VOCAB)
    m.fill_bitmask(bm, 0)
    assert torch.equal(bm, masks[len(ids) - 2])
    assert not m.accept_tokens(ids[-2:] + [ids[0]])  # last token invalid: nothing advances
    m.fill_bitmask(bm, 0)
    assert torch.equal(bm, masks[len(ids) - 2])
    m.reset()
    m.fill_bitmask(bm, 0)
    assert torch.equal(bm, masks[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_jump_forward(backend, compiled, tokenizer, vocab):
    m = compiled(backend, "json-compact").new_matcher()
    assert m.jump_forward_string() == '{"name":"'
    assert m.accept_tokens(tokenizer.encode('{"name":"ab"', add_special_tokens=False))
    assert m.jump_forward_string() == ',"'
    c = compiled(backend, "choice").new_matcher()
    assert c.jump_forward_string() == ""             # red | blue ...
    assert c.accept_tokens(tokenizer.encode("b", add_special_tokens=False))
    assert c.jump_forward_string() == "lue s"
    tokens = forced_tokens(c, ForcedTextEncoder(tokenizer, vocab))
    assert tokens and b"".join(vocab.token_bytes[t] for t in tokens) in (b"lue", b"lue s")
    assert c.jump_forward_string() == "lue s"[len(b"".join(vocab.token_bytes[t] for t in tokens)):]


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_and_special_ids_never_allowed(backend, tokenizer):
    padded = TokenVocab.from_tokenizer(tokenizer, VOCAB + 64)
    made = {"llguidance": lambda: LLGuidanceBackend(padded, tokenizer),
            "xgrammar": lambda: XGrammarBackend(padded), "outlines": lambda: OutlinesBackend(padded)}
    m = made[backend]().compile(P(json={"type": "string"}, whitespace="compact")).new_matcher()
    assert m.accept_tokens(tokenizer.encode('"', add_special_tokens=False))
    bm = allocate_bitmask(1, VOCAB + 64)
    m.fill_bitmask(bm, 0)
    allowed = set(allowed_token_ids(bm, 0, VOCAB + 64))
    assert len(allowed) > 40000 and max(allowed) < VOCAB
    assert not allowed & set(padded.special_ids)
    assert m.accept_tokens(tokenizer.encode('a"', add_special_tokens=False))
    m.fill_bitmask(bm, 0)
    assert allowed_token_ids(bm, 0, VOCAB + 64) == [padded.eos_token_id]


def test_outlines_rejects_what_it_cannot_enforce(backends):
    for params in (P(grammar=EBNF), P(structural_tag={"triggers": ["<f"], "structures": [
            {"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}]})):
        with pytest.raises(ValueError, match="outlines backend does not support"):
            backends["outlines"].check(params)


@pytest.mark.parametrize("regex", [r"\S(\s^)+[^a-c]+", r"(?: ^+)(b{2,}\W+|9b*?){3}?", r"a$b"])
def test_a_regex_no_text_matches_is_refused_before_the_engine(regex, backends, tokenizer):
    """An anchor that can never hold empties the regex's language: outlines-core's
    check (a one-token probe vocabulary) let it through, and its compile against the
    real vocabulary failed in the engine ("vocabulary incompatible"), for a stream
    after its 200. No backend serves it now, so auto refuses it up front too."""
    with pytest.raises(ValueError, match="no text matches this regex"):
        choose_backend(P(regex=regex, backend="outlines"))
    with pytest.raises(ValueError):
        choose_backend(P(regex=regex))
    wide = P(regex=r"[a-z]{1,500}", backend="outlines")       # 1 token: "incompatible"
    assert choose_backend(wide) == "outlines"
    backends["outlines"].compile(wide)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("shape", ["legacy", "vllm", "xgrammar-format"])
def test_structural_tag_tool_calls(backend, shape, backends, tokenizer, vocab):
    """Free text; each <tool_call> forced into a valid call. Three spellings: the
    legacy triggers/structures, vLLM's (the same with type), xgrammar's format."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    begin, end = '<tool_call>{"name": "weather", "arguments": ', "}</tool_call>"
    if shape == "xgrammar-format":
        tag = {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": ["<tool_call>"], "at_least_one": False,
            "stop_after_first": False, "tags": [{"type": "tag", "begin": begin, "end": end,
                                                 "content": {"type": "json_schema",
                                                             "json_schema": schema}}]}}
    else:
        tag = {"triggers": ["<tool_call>"], "structures": [
            {"begin": begin, "schema": schema, "end": end}]}
        if shape == "vllm":
            tag["type"] = "structural_tag"
    g = backends[backend].compile(P(structural_tag=tag, whitespace="compact"))
    call = '<tool_call>{"name": "weather", "arguments": {"city":"Paris"}}</tool_call>'
    for text in ("Just text.", "Sure. " + call, call + " done", call + call):
        assert accepts(g.new_matcher(), tokenizer, vocab, text), text
    for bad in (call.replace("city", "town"), "x <tool_call>garbage", "Sure. " + call[:-12]):
        assert not accepts(g.new_matcher(), tokenizer, vocab, bad), bad


def test_structural_tag_stop_after_first_and_patterns_through_llguidance(backends, tokenizer,
                                                                        vocab):
    """A tool schema with a `pattern` (xgrammar refuses patterns): auto serves the
    tag through llguidance, pattern exact; stop_after_first ends the output."""
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
              "required": ["code"], "additionalProperties": False}
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"], "at_least_one": False,
        "stop_after_first": True, "tags": [{"type": "tag", "begin": "<tool_call>",
                                            "end": "</tool_call>", "content": {
                                                "type": "json_schema", "json_schema": schema}}]}}
    params = P(structural_tag=tag, whitespace="compact")
    assert choose_backend(params) == "llguidance"
    g = backends["llguidance"].compile(params)
    call = '<tool_call>{"code":"ABC"}</tool_call>'
    assert accepts(g.new_matcher(), tokenizer, vocab, "Text. " + call)
    assert accepts(g.new_matcher(), tokenizer, vocab, "Only text.")
    for bad in (call.replace("ABC", "ABCD"), call + " more", call + call):
        assert not accepts(g.new_matcher(), tokenizer, vocab, bad), bad
    with pytest.raises(ValueError, match="xgrammar"):
        backends["llguidance"].check(P(structural_tag={"type": "structural_tag", "format": {
            "type": "tag", "begin": "<a>", "end": "</a>",
            "content": {"type": "json_schema", "json_schema": schema}}}))


def test_outlines_index_build_is_isolated_and_bounded():
    import outlines_core as oc

    from formwork.grammar.outlines_worker import build_index

    vocabulary = oc.Vocabulary(9, {b"a": [0], b"b": [1]})
    index = build_index("[ab]{2,3}", vocabulary, timeout_s=30.0)
    assert index.get_next_state(index.get_next_state(index.get_initial_state(), 0), 1) \
        in index.get_final_states()
    with pytest.raises(ValueError, match="did not finish compiling within 1 s"):
        build_index("(a|b)*a(a|b){20}", vocabulary, timeout_s=1.0)   # 2^20-state DFA
    with pytest.raises(ValueError, match="cannot compile"):
        build_index("a(?=b)", vocabulary, timeout_s=30.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_rejected_batch_is_taken_back(backend, backends, tokenizer, vocab):
    """A rejected list longer than the outlines guide's rollback window (256
    states) still leaves the matcher where it was (the coverage bench feeds whole
    instances at once)."""
    m = backends[backend].compile(P(regex="(ab){1,400}c")).new_matcher()
    head = tokenizer.encode("ab" * 10, add_special_tokens=False)
    assert m.accept_tokens(head)
    before = allocate_bitmask(1, VOCAB)
    m.fill_bitmask(before, 0)
    long = tokenizer.encode("ab" * 330, add_special_tokens=False)
    assert len(long) > 256
    assert not m.accept_tokens(long + tokenizer.encode("x", add_special_tokens=False))
    after = allocate_bitmask(1, VOCAB)
    m.fill_bitmask(after, 0)
    assert torch.equal(before, after)
    assert accepts(m, tokenizer, vocab, "abc")


def test_choose_backend_refuses_naming_the_problem_and_compiles_nothing():
    """The synchronous check the engine's compile starts with (grammar/manager.py)."""
    bad = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(ValueError, match=r"'uniqueItems' at \$\.properties\.tags"):
        choose_backend(P(json=bad))
    with pytest.raises(ValueError, match="invalid regex|cannot compile this regex"):
        choose_backend(P(regex="(a"))
    with pytest.raises(ValueError, match="grammar"):
        choose_backend(P(grammar="root ::= undefined_rule"))
    assert choose_backend(P(json=PERSON)) == "llguidance"


def test_a_lark_grammar_none_reads_gets_llguidances_reason():
    """Lark (no `::=`) is llguidance's dialect alone: a refused one is told where
    llguidance stopped, not xgrammar's "EBNF lexer error ... ':'"."""
    from formwork.grammar.selection import validate_params
    for check in (choose_backend, validate_params):
        with pytest.raises(ValueError, match=r"^llguidance cannot compile this grammar: 1\(14\)"):
            check(P(grammar='start: "a" "\\U0001f600"'))
    with pytest.raises(ValueError, match="xgrammar"):        # GBNF: xgrammar's reason
        choose_backend(P(grammar="root ::= undefined_rule"))


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar", "outlines", "auto"])
@pytest.mark.parametrize("ref", ["other.json#/definitions/x", "https://example.com/s.json"])
def test_a_remote_ref_is_named_on_every_backend(backend, ref):
    """A `$ref` to another document is refused as that `$ref` at its path on every
    backend (llguidance's own message named the first regex-making keyword of the
    schema, e.g. 'const' on drone-ci's schema from SchemaStore)."""
    schema = {"type": "object", "properties": {"kind": {"const": "pipeline"}, "meta": {"$ref": ref}},
              "required": ["meta"]}
    with pytest.raises(ValueError, match=re.escape(f"'$ref' at $.properties.meta (cannot resolve {ref!r}")):
        choose_backend(P(json=schema, backend=backend))
    anchored = {"$id": "https://example.com/root.json", "type": "object",
                "properties": {"m": {"$ref": "https://example.com/root.json#/$defs/a"}},
                "$defs": {"a": {"type": "integer"}}}
    if backend in ("llguidance", "auto"):          # its own $id: resolved, not remote
        assert choose_backend(P(json=anchored, backend=backend)) == "llguidance"


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar", "outlines", "auto"])
def test_a_ref_to_nothing_beside_values_is_named_on_every_backend(backend):
    """A `$ref` pointing nowhere beside a `const` (a schema whose `$defs` sit below
    the node that refers to them: tool parameters wrapping such a schema): the
    enum-against-siblings rule validated the const through the ref and jsonschema's
    PointerToNowhere escaped the check (a 500 on the server, about pickling it)."""
    schema = {"type": "object", "properties": {"x": {"const": "a", "$ref": "#/$defs/d"}},
              "required": ["x"]}
    with pytest.raises(ValueError, match=re.escape("'$ref' at $.properties.x (cannot resolve")):
        choose_backend(P(json=schema, backend=backend))


@pytest.mark.parametrize("schema, keyword, path", [
    ({"type": "object", "patternProperties": {"^a": {"type": "string"}, "b$": {"type": "integer"}}},
     "patternProperties", "$"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf", "$"),
])
def test_llguidances_other_refusals_name_their_keyword(schema, keyword, path):
    """Messages that named no keyword were pinned on the root `type` (overlapping
    patternProperties) or on a branch's `type` (an allOf no value meets)."""
    with pytest.raises(ValueError, match=re.escape(f"keyword '{keyword}' at {path} (llguidance")):
        choose_backend(P(json=schema, backend="llguidance"))


def test_a_schema_too_deep_for_llguidance_names_the_depth_and_is_served_by_xgrammar():
    deep = json.loads('{"type": "array", "items": ' * 130 + "{}" + "}" * 130)
    with pytest.raises(ValueError, match=r"^unsupported JSON Schema at \$(\.items){124} \(nested deeper"):
        choose_backend(P(json=deep, backend="llguidance"))
    assert choose_backend(P(json=deep)) == "xgrammar"
    ok = json.loads('{"type": "array", "items": ' * 123 + "{}" + "}" * 123)     # 124 deep
    assert choose_backend(P(json=ok, backend="llguidance")) == "llguidance"


def test_a_schema_over_llguidances_size_budget_is_named_so_and_served_by_xgrammar():
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20_000)}}
    with pytest.raises(ValueError, match=r"^unsupported JSON Schema at \$ \(too large for llguidance"):
        choose_backend(P(json=big, backend="llguidance"))
    assert choose_backend(P(json=big)) == "xgrammar"


# GBNF that llguidance's own converter (1.9.1) could not hand to llguidance: nested
# repetitions printed `x++`, escapes with leading zeros printed `\ue9`, `\-` / `\^`
# in a class refused. Each must read as xgrammar reads it.
GBNF_AS_XGRAMMAR = [
    ('root ::= (([a-f])+)+', ["abc", "f"], ["g", "ab1"]),
    ('root ::= (("{)"){2}){1}', ["{){)"], ["{)", "{){){)"]),
    ('root ::= (("ab")?)* "c"', ["c", "ababc"], ["abac"]),
    ('root ::= "\\u00e9" [\\u00e0-\\u00ff]+', ["éà", "éÿÿ"], ["e", "éa"]),
    ('root ::= "\\U0001F600" "\\u0400" "\\u0041"', ["😀ЀA"], ["😀Ѐ"]),
    ('root ::= [^\\-\\^"]+', ["ab c"], ["a-b", "^", 'a"']),
    ('root ::= "a\\\\u0041"', ["a\\u0041"], ["aA"]),
]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("grammar,good,bad", GBNF_AS_XGRAMMAR)
def test_gbnf_reads_the_same_on_llguidance_as_on_xgrammar(backend, grammar, good, bad, backends,
                                                          tokenizer, vocab):
    g = backends[backend].compile(P(grammar=grammar))
    for text in good:
        assert accepts(g.new_matcher(), tokenizer, vocab, text), (backend, text)
    for text in bad:
        assert not accepts(g.new_matcher(), tokenizer, vocab, text), (backend, text)


# Repetitions of what can be empty (xgrammar's parser splits the text in ever more
# ways: 32 ms a mask every token for the first, 0.2-1 s and its fill limit for the
# second), with what each means as a Python regex.
REPEATS_THE_EMPTY = [   # (grammar, its language, what its unfinished texts can be)
    ('root ::= ([a-z]+ | " "*)*', r"[a-z ]*", r"[a-z ]*"),
    ('root ::= (w | s)* "."\nw ::= [a-z]+\ns ::= [ ]*', r"[a-z ]*\.", r"[a-z ]*"),
    ('root ::= ((([a-z]*)*)*) "!"', r"[a-z]*!", r"[a-z]*"),
    ('root ::= x{2,5} "."\nx ::= "" | "ab"', r"(ab){0,5}\.", r"(ab){0,5}a?"),
]


@pytest.mark.parametrize("grammar,language,prefixes", REPEATS_THE_EMPTY)
def test_a_grammar_repeating_what_can_be_empty_goes_to_llguidance_and_holds(
        grammar, language, prefixes, backends, vocab):
    from formwork.grammar.gbnf_lark import repeats_what_can_be_empty
    assert repeats_what_can_be_empty(grammar)
    assert choose_backend(P(grammar=grammar)) == "llguidance"
    g = backends["llguidance"].compile(P(grammar=grammar))
    for seed in range(4):
        text, done = random_walk(g.new_matcher(), vocab, random.Random(seed), max_steps=40)
        assert re.fullmatch(language if done else prefixes, text), (grammar, text, done)


@pytest.mark.parametrize("grammar", [
    'root ::= ("a" [b]?)* "c"',                     # the repeated part is never empty
    'root ::= x? "c"\nx ::= "" | "a"',                # an empty part, not repeated
    'root ::= object\nobject ::= "{" ws (pair ("," ws pair)*)? "}"\n'
    'pair ::= [a-z]+ ":" ws [0-9]+\nws ::= "" | " " | "\\n" [ \\t]{0,20}',  # llama.cpp's shape
])
def test_other_gbnf_stays_on_xgrammar(grammar):
    from formwork.grammar.gbnf_lark import repeats_what_can_be_empty
    assert not repeats_what_can_be_empty(grammar)
    assert choose_backend(P(grammar=grammar)) == "xgrammar"
