"""outlines-core constraints as regexes, without torch: `to_regex` is the
outlines backend's check (grammar/selection.py, run in the gateway process too)
and what grammar/outlines_backend.py compiles."""
from __future__ import annotations

import json

import outlines_core as oc

from formwork.grammar.outlines_worker import build_index, build_json_regex
from formwork.grammar.regex_classes import portable_classes
from formwork.grammar.regex_safety import escape_literal
from formwork.grammar.schema_check import check_schema, native_schema_error
from formwork.schemas.structured import StructuredOutputsParams

# Index build time grows with the regex (measured on 2 busy cores: 5k chars ~2 s,
# 20k chars 4-16 s, 765k chars did not finish in minutes): refuse larger ones
# up front instead of waiting for the compile deadline.
MAX_REGEX_CHARS = 20_000
REGEX_BUILD_TIMEOUT_S = 10.0


def whitespace_pattern(params: StructuredOutputsParams) -> str:
    if params.whitespace_pattern is not None:      # checked: JSON whitespace only
        return f"(?:{params.whitespace_pattern})"
    if params.whitespace == "compact" or params.max_whitespace == 0:
        return ""
    return f"[ \\t\\n\\r]{{0,{params.max_whitespace}}}"


def to_regex(params: StructuredOutputsParams) -> str:
    """Check `params` and return the regex outlines-core will enforce."""
    kind, spec = params.kind(), params.spec()
    ws = whitespace_pattern(params)
    if params.additional_properties == "schema" and kind == "json":
        raise ValueError("structured_outputs.additional_properties='schema' is served by "
                         "backend 'llguidance' only")
    if kind == "json":
        schema = check_schema(spec, "outlines")
        schema = {} if schema is True else schema
        try:
            regex = build_json_regex(json.dumps(schema), ws, REGEX_BUILD_TIMEOUT_S)
        except ValueError as err:
            raise native_schema_error(spec, str(err), "outlines") from None
        if len(regex) > MAX_REGEX_CHARS:
            raise native_schema_error(spec, f"the schema becomes a {len(regex)}-char regex (limit "
                                            f"{MAX_REGEX_CHARS}); use backend='auto'", "outlines")
        return regex
    if kind == "json_object":
        # measured: the index for "any JSON object" does not build within the 30 s
        # compile limit on a 2-core machine; refuse up front instead of timing out.
        raise ValueError("the outlines backend cannot enforce json_object (arbitrary JSON "
                         "compiles too slowly); use backend='auto'")
    if kind == "regex":
        # classes as on the other backends (outlines-core's are Unicode-aware)
        regex = portable_classes(spec)
        _check_regex_syntax(regex)
        return regex
    if kind == "choice":
        return "(" + "|".join(escape_literal(c) for c in spec) + ")"
    raise ValueError(f"the outlines backend does not support '{kind}' constraints; "
                     "use backend='auto'")


# Every byte a token of its own: any text is a path of tokens, so "incompatible
# vocabulary" from this probe means that no text matches the regex (an anchor that
# can never hold: `\s^`, `a$b`). Such a regex passed the check (a one-token probe,
# for which "incompatible" was expected) and failed in the engine against the real
# vocabulary: for a stream, an error event after its 200. About as fast as one token.
_PROBE_VOCABULARY = oc.Vocabulary(256, {bytes([b]): [b] for b in range(256)})


def _check_regex_syntax(regex: str) -> None:
    """Raise ValueError if outlines-core cannot build a DFA for `regex` (syntax,
    look-around, Unicode word boundaries, size), or if no text matches it."""
    try:
        build_index(regex, _PROBE_VOCABULARY, timeout_s=REGEX_BUILD_TIMEOUT_S)
    except ValueError as err:
        if "incompatible" in str(err):
            raise ValueError("outlines-core: no text matches this regex (an anchor inside it, "
                             "such as ^ after a character or $ before one, can never hold), "
                             "so no output could be written") from None
        raise ValueError(str(err).replace("this constraint", "this regex")) from None
