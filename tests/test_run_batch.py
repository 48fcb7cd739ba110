"""`formwork run-batch` (vLLM's run_batch): an OpenAI Batch API file through the
server's own request path in one process: every line answered in input order in
OpenAI's batch output format, constrained outputs valid, refusals as the server
gives them, lines that are no request recorded with an error, never dropped."""
from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest

from formwork.gateway.run_batch import parse_line

CLI = (sys.executable, "-m", "formwork.gateway.cli")
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"], "additionalProperties": False}


def _chat(content: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 40, **extra}


@pytest.mark.parametrize("line,code", [
    ("not json", "invalid_json"),
    ("[1]", "invalid_request"),
    ('{"url": "/v1/completions", "body": {}}', "invalid_request"),          # no custom_id
    ('{"custom_id": "a", "method": "GET", "url": "/v1/models", "body": {}}', "invalid_request"),
    ('{"custom_id": "a", "url": "/v1/embeddings", "body": {}}', "invalid_url"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": "x"}', "invalid_request"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "stream": true}}',
     "invalid_request"),
])
def test_lines_that_are_no_request_get_an_error_line(line, code):
    out = parse_line(line, 3, set())
    assert out["response"] is None and out["error"]["code"] == code
    assert out["error"]["message"].startswith("line 3: ") and out["id"].startswith("batch_req_")


def test_a_repeated_custom_id_is_an_error_and_a_request_parses():
    seen: set[str] = set()
    line = json.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": _chat("hi")})
    assert parse_line(line, 1, seen) == ("a", "/v1/chat/completions", _chat("hi"))
    assert parse_line(line, 2, seen)["error"]["code"] == "duplicate_custom_id"


def test_input_lines_are_split_at_line_ends_only(tmp_path):
    """JSON allows U+2028, U+0085 and U+2029 raw inside a string (text pasted from a
    web page holds them); str.splitlines() broke such a request line in two
    "invalid_json" errors."""
    from formwork.gateway.run_batch import _read_lines
    req = {"custom_id": "a", "url": "/v1/completions",
           "body": {"prompt": "one\u2028two\x85three\u2029four"}}
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(req, ensure_ascii=False) + "\r\n\n" + json.dumps(req) + "\n",
                   encoding="utf-8")
    assert [json.loads(x) for x in _read_lines(str(src))] == [req, req]


def test_usage_errors_come_before_the_model_loads(tmp_path):
    r = subprocess.run([*CLI, "run-batch", "-i", str(tmp_path / "missing.jsonl"), "-o", "-"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "formwork run-batch:" in r.stderr and "missing.jsonl" in r.stderr


YES_NO = ["yes\u2028", "no\x85"]     # characters str.splitlines() breaks a line at


@pytest.mark.slow
def test_a_batch_file_runs_through_the_servers_request_path(tmp_path):
    lines = [
        {"custom_id": "city", "method": "POST", "url": "/v1/chat/completions", "body": _chat(
            "Name a city in France.", response_format={"type": "json_schema", "json_schema": {
                "name": "city", "schema": CITY}})},
        {"custom_id": "rome", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "The capital of Italy is", "max_tokens": 5, "temperature": 0}},
        {"custom_id": "yesno", "url": "/v1/responses",
         "body": {"input": "Yes\u2028or no?", "structured_outputs": {"choice": YES_NO}}},
        "not json",
        {"custom_id": "hot", "url": "/v1/chat/completions", "body": _chat("hi", temperature=5)},
        {"custom_id": "rome", "url": "/v1/completions", "body": {"prompt": "x"}},
    ] + [{"custom_id": f"n{i}", "url": "/v1/chat/completions", "body": _chat(
        f"Name city number {i}.", response_format={"type": "json_schema", "json_schema": {
            "name": "city", "schema": CITY}})} for i in range(12)]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(x if isinstance(x, str) else json.dumps(x, ensure_ascii=False)
                             for x in lines) + "\n", encoding="utf-8")
    r = subprocess.run([*CLI, "run-batch", "-i", str(src), "-o", str(tmp_path / "out.jsonl"),
                        "--max-model-len", "1k", "--max-num-seqs", "4", "--concurrency", "5"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [x["custom_id"] if isinstance(x, dict) else None
                                            for x in lines]            # input order, none lost
    assert len({o["id"] for o in out}) == len(out)
    for o in [out[0]] + out[6:]:
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and o["error"] is None
        assert o["response"]["request_id"] == body["id"]
        choice = body["choices"][0]
        assert choice["formwork"]["valid"] is True
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), CITY)
    assert out[1]["response"]["body"]["choices"][0]["text"].strip()
    # read with splitlines() above: U+2028 / U+0085 in an output are escaped in its line
    assert out[2]["response"]["body"]["output"][0]["content"][0]["text"] in YES_NO
    assert out[3]["error"]["code"] == "invalid_json" and out[3]["response"] is None
    refused = out[4]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "temperature"
    assert out[5]["error"]["code"] == "duplicate_custom_id"
    assert "18 requests: 15 answered, 1 refused by the server, 2 not requests" in r.stderr
