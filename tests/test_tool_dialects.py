"""A tool's parameters keep the meaning of the JSON Schema draft they declare under
tool_choice "required", where every tool's schema is embedded in one wrapper
document (gateway/tools.py). The wrapper used to be 2020-12 whatever a draft-04
tool said: `const` (no keyword in draft 4) became one, and a draft-04
`oneOf: [{"type": "string"}, {"const": 0}]` (no string passes: both branches do)
let strings out as the call's arguments; a draft-04 boolean `exclusiveMinimum`
made the wrapper invalid, refusing a tool that is served alone."""
from __future__ import annotations

import jsonschema
import pytest

from formwork.gateway.errors import APIError
from formwork.gateway.tool_parser import parse_tool_output
from formwork.gateway.tools import LLAMA3_JSON, resolve_tool_mode, tool_constraint
from formwork.grammar.selection import validate_params
from formwork.schemas.openai import ChatCompletionRequest
from formwork.schemas.structured import StructuredOutputsParams

DRAFT4 = "http://json-schema.org/draft-04/schema#"
DRAFT7 = "http://json-schema.org/draft-07/schema#"
MSGS = [{"role": "user", "content": "hi"}]


def tool(name: str, params: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def mode(tools, choice="required", parallel=False, fmt=None):
    req = ChatCompletionRequest(messages=MSGS, tools=tools, tool_choice=choice,
                                parallel_tool_calls=parallel)
    return resolve_tool_mode(req, fmt) if fmt is not None else resolve_tool_mode(req)


def valid(schema: dict, value) -> bool:
    return jsonschema.validators.validator_for(schema)(schema).is_valid(value)


ONE_OF = {"$schema": DRAFT4, "type": "object", "required": ["x"],
          "properties": {"x": {"oneOf": [{"type": "string"}, {"const": 0}]}}}
EXCLUSIVE = {"$schema": DRAFT4, "type": "object", "required": ["n"],
             "properties": {"n": {"type": "integer", "minimum": 0, "exclusiveMinimum": True,
                                  "maximum": 5}}}


@pytest.mark.parametrize("parallel", [False, True])
def test_a_draft04_tool_is_read_as_draft04_inside_the_wrapper(parallel):
    m = mode([tool("f", ONE_OF)], parallel=parallel)
    assert not m.tagged
    wrapper = tool_constraint(m).json
    call = (lambda args: [{"name": "f", "arguments": args}]) if parallel else \
        (lambda args: {"name": "f", "arguments": args})
    assert not valid(ONE_OF, {"x": "s"}) and valid(ONE_OF, {"x": 1})
    assert not valid(wrapper, call({"x": "s"})) and valid(wrapper, call({"x": 1}))
    # the same verdict as the tool alone (tool_choice naming it): refused, naming oneOf
    with pytest.raises(ValueError, match="'oneOf' at"):
        validate_params(StructuredOutputsParams(json=ONE_OF), "auto")
    with pytest.raises(ValueError, match="'oneOf' at"):
        validate_params(tool_constraint(m), "auto")


def test_a_draft04_boolean_bound_is_served_under_required_as_alone():
    m = mode([tool("f", EXCLUSIVE), tool("g", {"$schema": DRAFT4, "type": "object"})])
    validate_params(StructuredOutputsParams(json=EXCLUSIVE), "auto")
    so = tool_constraint(m)
    validate_params(so, "auto")                       # refused before (2020-12 meta-schema)
    assert not valid(so.json, {"name": "f", "arguments": {"n": 0}})
    assert valid(so.json, {"name": "f", "arguments": {"n": 1}})


def test_tools_in_different_drafts_share_one_document_only_where_each_reads_the_same():
    """One document cannot read its parts under different drafts. A draft-07 tool
    that means the same under 2020-12 (zod's and MCP servers' schemas, mostly) joins
    the others in one JSON wrapper; one that does not (a `$ref` whose siblings draft 7
    ignores) makes the calls tagged, each call's arguments a document of its own."""
    plain = tool("plain", {"type": "object", "properties": {"a": {"type": "integer"}},
                           "required": ["a"]})
    same = tool("same", {"$schema": DRAFT7, "type": "object", "required": ["b"],
                         "properties": {"b": {"$ref": "#/definitions/B", "description": "b"}},
                         "definitions": {"B": {"type": "boolean"}}})
    other = tool("other", {"$schema": DRAFT7, "type": "object", "required": ["b"],
                           "properties": {"b": {"$ref": "#/definitions/B", "type": "string"}},
                           "definitions": {"B": {"type": "boolean"}}})
    m = mode([plain, same])
    assert not m.tagged
    wrapper = tool_constraint(m).json
    assert "$schema" not in wrapper and valid(wrapper, {"name": "same", "arguments": {"b": True}})
    m = mode([plain, other])
    assert m.tagged
    so = tool_constraint(m)
    assert so.structural_tag is not None
    validate_params(so, "auto")
    assert valid(other["function"]["parameters"], {"b": True})     # draft 7: the ref alone
    text = '<tool_call>\n{"name": "other", "arguments": {"b": true}}\n</tool_call>'
    content, calls = parse_tool_output(m, text)
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [
        ("other", '{"b": true}')]
    all_seven = tool_constraint(mode([other, tool("seven", {"$schema": DRAFT7})]))
    assert all_seven.json["$schema"] == DRAFT7      # one draft: the wrapper's own
    assert valid(all_seven.json, {"name": "other", "arguments": {"b": True}})


def test_different_drafts_in_a_tagless_format_are_refused_naming_the_tool():
    plain = tool("plain", {"type": "object"})
    four = tool("four", EXCLUSIVE)
    m = mode([plain, four], fmt=LLAMA3_JSON)
    with pytest.raises(APIError) as e:
        tool_constraint(m)
    assert e.value.status == 400 and e.value.param == "tools[1].function.parameters"
    assert "would mean something else" in e.value.message
