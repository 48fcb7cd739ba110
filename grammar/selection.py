"""Which backend enforces a constraint: checks that need no tokenizer.

`backend="auto"` tries, per constraint kind, the backends that can serve it in a
fixed order -- soundness first (a backend is tried only where it enforces every
keyword exactly, or refuses), then coverage, then speed -- and takes the first
that accepts. Orders (measured, see README "Structured outputs"):

- json, json_object: llguidance, xgrammar, outlines. llguidance's JSON compiler
  is exact where it accepts (patterns, lengths, string escapes) and refuses what
  it does not implement; xgrammar and outlines-core serve what it refuses, each
  behind formwork's own keyword rules.
- regex: llguidance, xgrammar, outlines (all exact, and every backend reads the
  classes alike: regex_classes.py). llguidance matches a regex with a lazily
  built DFA, so a mask does not cost more as the text grows; xgrammar's parser
  keeps every way an ambiguous regex can split the text so far, and for everyday
  ones (`([a-z]+ ?)+\\.`, `(\\w+\\s?)*`) a mask took 25-160 ms a token, growing
  until its time limit failed the request (bench/regex_backends.py, 524 regexes
  walked 96 tokens each: xgrammar failed 24 walks by its time limits, worst step
  4.2 s; llguidance none, worst step 8 ms). xgrammar serves what llguidance refuses
  (`\\0`, `[\\b]`, `\\cA`).
- choice: llguidance, xgrammar, outlines (an alternation of literals: exact and
  unambiguous on each; llguidance compiles a long list faster -- 1,000 choices
  20 vs 79 ms, 100,000 3 vs 32 s, past the default 30 s compile timeout).
- grammar: xgrammar (its EBNF is the documented dialect), then llguidance (Lark,
  and GBNF converted). A GBNF grammar that repeats a part that can match the
  empty string (`(w | s)*` with `s ::= [ ]*`) goes to llguidance first: xgrammar's
  parser splits the text in ever more ways there (a mask 32 ms every token, or
  212, 327, 944 ms and the fill limit), llguidance's took 0-3 ms (gbnf_lark.py).
- structural_tag: xgrammar (its own format language), then llguidance (triggered
  tags with JSON schemas; serves the tool schemas xgrammar refuses, e.g. patterns).

When none accepts, the first backend's reason is raised (for regexes and GBNF
xgrammar's, which names the fault and its position; for Lark llguidance's), e.g. "unsupported JSON
Schema keyword 'uniqueItems' at $.properties.tags". Explicit backends are checked
the same way and never substituted.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from formwork.grammar.xgrammar_productive import NoFiniteOutput, recursive_refs
from formwork.schemas.structured import StructuredOutputsParams

# Each backend's check is its own converter (whether it accepts a constraint is
# what its native parser says), so it needs that backend's library. Each is
# imported by the first check that tries it: the gateway process runs these
# checks, and xgrammar imports torch (~1 s), which the gateway never needs while
# llguidance and outlines-core accept its constraints.


def _llguidance(params: StructuredOutputsParams) -> Any:
    from formwork.grammar.llguidance_grammar import to_llguidance  # lazily: see above
    return to_llguidance(params)


def _finite(params: StructuredOutputsParams) -> None:
    """A constraint no output of which can end is refused for every backend
    (llguidance writes into it until max_tokens; xgrammar's jump-forward never
    returned): a schema with no finite instance (recursive schemas only, alone or
    in a structural tag), a GBNF grammar with a rule that derives no finite text.
    Read on xgrammar's conversion, so xgrammar loads only for those."""
    kind, spec = params.kind(), params.spec()
    if kind == "grammar":
        from formwork.grammar.xgrammar_backend import check_finite_grammar  # lazily: see above
        check_finite_grammar(spec)
        return
    if kind == "json":
        schemas = [spec]
    elif kind == "structural_tag":
        schemas = list(_tag_schemas(spec))
    else:
        return
    for schema in schemas:
        if isinstance(schema, dict) and recursive_refs(schema):
            from formwork.grammar.xgrammar_backend import check_finite_json  # lazily
            check_finite_json(schema)


def _tag_schemas(node: Any):
    """The JSON schemas inside a structural tag spec (every format's spelling)."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
            yield node["json_schema"]
        elif "begin" in node and isinstance(node.get("schema"), dict):
            yield node["schema"]
        for v in node.values():
            yield from _tag_schemas(v)
    elif isinstance(node, list):
        for v in node:
            yield from _tag_schemas(v)


def _xgrammar(params: StructuredOutputsParams) -> Any:
    from formwork.grammar.xgrammar_backend import to_xgrammar  # lazily: see above
    return to_xgrammar(params)


def _outlines(params: StructuredOutputsParams) -> Any:
    from formwork.grammar.outlines_grammar import to_regex  # lazily: see above
    return to_regex(params)


CHECKS: dict[str, Callable[[StructuredOutputsParams], Any]] = {
    "llguidance": _llguidance, "xgrammar": _xgrammar, "outlines": _outlines}
ALIASES = {"guidance": "llguidance"}   # vLLM's name
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "json": ("llguidance", "xgrammar", "outlines"),
    "json_object": ("llguidance", "xgrammar"),
    "regex": ("llguidance", "xgrammar", "outlines"),
    "choice": ("llguidance", "xgrammar", "outlines"),
    "grammar": ("xgrammar", "llguidance"),
    "structural_tag": ("xgrammar", "llguidance"),
}
# Whose reason is raised when no backend accepts, where not the first's: xgrammar
# names a regex's fault and its position ("The parenthesis is not closed",
# "Lookahead is not supported yet"); llguidance's message stops at "regex parse
# error:".
REFUSAL_FROM: dict[str, str] = {"regex": "xgrammar"}


def _auto_order(params: StructuredOutputsParams) -> tuple[str, ...]:
    """AUTO_ORDER, but a GBNF grammar that repeats what can be empty goes to
    llguidance first: xgrammar's parser slows on it (gbnf_lark.py)."""
    kind = params.kind()
    if kind == "grammar":
        from formwork.grammar.gbnf_lark import is_gbnf, repeats_what_can_be_empty  # lazily
        if is_gbnf(params.spec()) and repeats_what_can_be_empty(params.spec()):
            return ("llguidance", "xgrammar")
    return AUTO_ORDER[kind]


def _refusal_from(params: StructuredOutputsParams, order: tuple[str, ...]) -> str:
    """Whose reason a refused constraint gets. A grammar that is not GBNF is Lark, which
    only llguidance reads: xgrammar's "EBNF lexer error ... ':'" would say nothing;
    GBNF is xgrammar's dialect, whichever backend was tried first."""
    if params.kind() == "grammar":
        from formwork.grammar.gbnf_lark import is_gbnf  # lazily: it imports llguidance
        return "xgrammar" if is_gbnf(params.spec()) else "llguidance"
    return REFUSAL_FROM.get(params.kind(), order[0])


def choose_backend(params: StructuredOutputsParams, default_backend: str = "auto") -> str:
    """Validate `params` and return the name of the backend that serves it;
    ValueError (UnsupportedSchemaError for JSON Schema keywords) if none can.

    `default_backend` replaces `params.backend == "auto"` when it is not "auto".
    """
    return _choose(params, default_backend, llguidance_first=False)


def validate_params(params: StructuredOutputsParams, default_backend: str = "auto") -> None:
    """Synchronous check for the gateway (a 400 before queueing): spec shape,
    JSON Schema meta-schema, unenforceable keywords, regex/grammar syntax.
    Raises ValueError naming the problem (keyword + JSON path for schemas);
    compiles no grammar against a tokenizer.

    The same verdict as `choose_backend` (some backend accepts, else the first
    backend's error), reached trying llguidance first: it needs no torch, and
    whichever backend the engine then picks, one accepts."""
    _choose(params, default_backend, llguidance_first=True)


def _choose(params: StructuredOutputsParams, default_backend: str, *,
            llguidance_first: bool) -> str:
    """The requested backend if it accepts; for "auto" the first in AUTO_ORDER that
    accepts (tried llguidance first when asked: the verdict is the same), else the
    error of AUTO_ORDER's first backend (`_refusal_from`'s where it names one)."""
    name = _requested(params, default_backend)
    _finite(params)                         # true for every backend
    if name != "auto":
        CHECKS[name](params)
        return name
    order = _auto_order(params)
    tries = sorted(order, key=lambda c: c != "llguidance") if llguidance_first else order
    errors: dict[str, ValueError] = {}
    for candidate in tries:                 # sorted is stable: the rest keep their order
        try:
            CHECKS[candidate](params)
            return candidate
        except ValueError as err:
            if isinstance(err, NoFiniteOutput):
                raise                       # true for every backend (xgrammar's own read)
            errors[candidate] = err
    raise errors[_refusal_from(params, order)]


def _requested(params: StructuredOutputsParams, default_backend: str) -> str:
    """`params.validate()`, then the backend asked for ("auto" or a known name)."""
    params.validate()
    name = params.backend if params.backend != "auto" else default_backend
    name = ALIASES.get(name, name)
    if name != "auto" and name not in CHECKS:
        raise ValueError(f"unknown grammar backend {name!r}; choose one of {['auto', *CHECKS]}")
    return name
