"""`formwork extract --server` against the real `formwork serve` (default model,
one server for the module) through the official openai client, and against a
stub OpenAI-compatible server (one character = one token, with or without
/tokenize) that checks the long-document handling exactly and fast."""
from __future__ import annotations

import dataclasses
import json
import threading
import time

import jsonschema
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from formwork.gateway.extract import cli as extract_cli
from formwork.gateway.extract import prompt
from formwork.gateway.extract.inputs import Document
from test_extract import DOCS as BASE_DOCS
from test_extract import MAX_MODEL_LEN, MAX_TOKENS, SCHEMA, parse
from test_server import KEY, Server, free_port

DOCS = {**BASE_DOCS, "c.txt": "Li Wei was born in Shanghai."}


@pytest.fixture(scope="module")
def server_url():
    server = Server("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-gb", "0.5",
                    timeout_s=900)
    yield server.url
    server.stop()


@pytest.fixture
def setup(tmp_path):
    (tmp_path / "person.json").write_text(json.dumps(SCHEMA))
    for name, text in DOCS.items():
        (tmp_path / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "docs" / name).write_text(text)
    return tmp_path / "person.json", tmp_path / "docs", tmp_path / "out.jsonl"


@pytest.mark.slow
def test_extract_through_server(server_url, setup, capsys):
    schema, docs, out = setup
    (docs / "long.txt").write_text("Jane Doe lives in Paris. " * 200)   # > the server's context
    rc = extract_cli.run(parse("--schema", str(schema), str(docs), "-o", str(out), "-q",
                           "--server", server_url, "--api-key", KEY, "--max-tokens", str(MAX_TOKENS),
                           "--concurrency", "2"))
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == sorted([*DOCS, "long.txt"])
    err = capsys.readouterr().err
    assert "long.txt: too long, truncated" in err and "/tokenize" not in err
    long = records.pop("long.txt")
    assert long["truncated"] is True and long["finish_reason"] in ("stop", "length"), long
    assert long["usage"]["prompt_tokens"] + MAX_TOKENS <= MAX_MODEL_LEN
    assert long["usage"]["prompt_tokens"] > MAX_MODEL_LEN - MAX_TOKENS - 16  # cut to fill the room
    assert rc == (0 if long["valid"] and all(r["valid"] for r in records.values()) else 1)
    for r in [long, *records.values()]:
        if r["valid"]:
            jsonschema.validate(r["data"], SCHEMA)
            assert r["finish_reason"] == "stop" and r["usage"]["completion_tokens"] > 0
        else:
            assert r["error"], r
    assert not any(r["truncated"] for r in records.values())
    assert any(r["valid"] for r in records.values()), records


@pytest.mark.slow
def test_long_document_skipped_through_server(server_url, setup, capsys):
    schema, docs, out = setup
    long = docs.parent / "long.txt"
    long.write_text("Jane Doe lives in Paris. " * 200)
    rc = extract_cli.run(parse("--schema", str(schema), str(long), "-o", str(out), "-q",
                           "--server", server_url, "--api-key", KEY, "--max-tokens", str(MAX_TOKENS),
                           "--on-long", "skip"))
    [rec] = [json.loads(line) for line in out.read_text().splitlines()]
    assert rc == 1 and rec["valid"] is False and rec["finish_reason"] is None
    assert "skipped (--on-long skip)" in rec["error"] and rec["usage"]["completion_tokens"] == 0
    assert "too long, skipped" in capsys.readouterr().err


@pytest.mark.slow
def test_server_refusals(server_url, setup, capsys):
    schema, docs, out = setup
    common = ("--schema", str(schema), str(docs), "-o", str(out), "-q", "--server", server_url)
    # the model list is refused: a setup error, nothing written
    assert extract_cli.run(parse(*common, "--api-key", "wrong")) == 2
    assert "cannot list its models" in capsys.readouterr().err and not out.exists()
    # each request refused: every document recorded as failed
    rc = extract_cli.run(parse(*common, "--api-key", "wrong", "--server-model", "any"))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert rc == 1 and sorted(r["id"] for r in records) == sorted(DOCS)
    assert all(r["error"].startswith("server error 401") and not r["valid"] for r in records)
    assert f"{len(DOCS)} documents: 0 ok, 0 invalid, {len(DOCS)} failed" in capsys.readouterr().err


def test_unreachable_server_is_a_setup_error(setup, capsys):
    schema, docs, out = setup
    rc = extract_cli.run(parse("--schema", str(schema), str(docs), "-o", str(out), "-q",
                           "--server", f"http://127.0.0.1:{free_port()}", "--timeout", "5"))
    assert rc == 2 and "cannot list its models" in capsys.readouterr().err
    assert not out.exists()


# ---- a stub server: exact token arithmetic, no model ---------------------------------

STUB_LEN = 1500            # its max_model_len
OVERHEAD = 7               # template tokens around the messages' characters
LONG_TEXT = "Ana Lima lives in Lisbon. " * 120  # 3120 characters
ANSWER = json.dumps({"name": "Jane Doe", "city": "Paris"})


def stub_count(messages: list[dict]) -> int:
    return OVERHEAD + sum(len(m["content"]) for m in messages)


def stub_app(seen: dict, tokenize: bool) -> FastAPI:
    """/v1/models, /v1/chat/completions (refuses what exceeds STUB_LEN, as vLLM does)
    and, with `tokenize`, vLLM's /tokenize and /detokenize. `seen`: the documents
    (user messages) of the chat requests it answered."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub", "object": "model", "created": 0,
                                            "owned_by": "test"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        n = stub_count(body["messages"])
        if n + body["max_tokens"] > STUB_LEN:
            return JSONResponse({"error": {"message": "maximum context length exceeded",
                                           "type": "invalid_request_error", "param": "messages",
                                           "code": None}}, status_code=400)
        seen.append(body["messages"][1]["content"])
        return {"id": "c", "object": "chat.completion", "created": 0, "model": "stub",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": ANSWER}}],
                "usage": {"prompt_tokens": n, "completion_tokens": 9, "total_tokens": n + 9}}

    if tokenize:
        @app.post("/tokenize")
        async def tokenize_route(body: dict):
            assert body["model"] == "stub"
            tokens = ([0] * stub_count(body["messages"]) if "messages" in body
                      else [ord(c) for c in body["prompt"]])
            return {"count": len(tokens), "max_model_len": STUB_LEN, "tokens": tokens}

        @app.post("/detokenize")
        async def detokenize_route(body: dict):
            return {"prompt": "".join(map(chr, body["tokens"]))}
    return app


@pytest.fixture(params=[True, False], ids=["with-tokenize", "no-tokenize"])
def stub(request):
    seen: list[str] = []
    server = uvicorn.Server(uvicorn.Config(stub_app(seen, request.param), host="127.0.0.1",
                                           port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{server.config.port}", seen, request.param
    server.should_exit = True
    thread.join(10)


def test_long_document_against_stub(stub, setup, capsys):
    url, seen, has_tokenize = stub
    schema, docs, out = setup
    (docs / "long.txt").write_text(LONG_TEXT)
    rc = extract_cli.run(parse("--schema", str(schema), str(docs), "-o", str(out), "-q",
                           "--server", url + "/v1", "--max-tokens", str(MAX_TOKENS)))
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    err = capsys.readouterr().err
    assert sorted(records) == sorted([*DOCS, "long.txt"])
    for name, text in DOCS.items():        # short ones go whole, either way
        assert records[name]["valid"] and not records[name]["truncated"]
        assert text in seen
    long = records["long.txt"]
    if has_tokenize:
        # cut to the longest prefix that leaves room for --max-tokens, exactly
        assert rc == 0 and long["valid"] and long["truncated"] is True
        assert long["usage"]["prompt_tokens"] == STUB_LEN - MAX_TOKENS
        [sent] = [t for t in seen if t.startswith("Ana Lima")]
        assert LONG_TEXT.startswith(sent) and len(sent) < len(LONG_TEXT)
        assert "long.txt: too long, truncated" in err and "/tokenize" not in err
    else:
        # today's behaviour, said once: sent whole, refused by the server
        assert rc == 1 and long["truncated"] is False and len(seen) == len(DOCS)
        assert long["error"].startswith("server error 400") and long["finish_reason"] is None
        assert err.count("has no /tokenize") == 1


@pytest.mark.parametrize("stub", [True], ids=["with-tokenize"], indirect=True)
def test_long_document_skipped_against_stub(stub, setup, capsys):
    url, seen, _ = stub
    schema, docs, out = setup
    (docs / "long.txt").write_text(LONG_TEXT)
    rc = extract_cli.run(parse("--schema", str(schema), str(docs), "-o", str(out), "-q",
                           "--server", url, "--max-tokens", str(MAX_TOKENS), "--on-long", "skip"))
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rc == 1 and sorted(seen) == sorted(DOCS.values())
    assert all(records[d]["valid"] for d in DOCS)
    assert "skipped (--on-long skip)" in records["long.txt"]["error"]
    assert "long.txt: too long, skipped" in capsys.readouterr().err
    # --max-tokens beyond the server's context: a usage error before anything is sent
    assert extract_cli.run(parse("--schema", str(schema), str(docs), "-o", str(out), "-q",
                             "--server", url, "--max-tokens", str(STUB_LEN))) == 2
    assert "leaves no room" in capsys.readouterr().err


class ShiftyMeter:
    """Characters as tokens, but a cut text re-measures 3 tokens longer (a
    re-tokenization shift), so fitting has to step back."""

    def count(self, messages):
        text = messages[1]["content"]
        return OVERHEAD + len(messages[0]["content"]) + len(text) + (3 if text.endswith("|") else 0)

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids)) + "|"


@pytest.mark.parametrize("doc_len", [0, 100, 400, 600, 2000])
def test_fit_document_steps_back_after_a_shift(doc_len):
    opts = prompt.ExtractOptions(schema=SCHEMA, max_tokens=MAX_TOKENS)
    meter, text = ShiftyMeter(), "x" * doc_len
    budget = 1000 - MAX_TOKENS
    empty = meter.count(prompt.build_messages("", opts))
    cut, full, n = prompt.fit_document(meter, text, opts, 1000)
    assert full == empty + doc_len
    if full <= budget:
        assert (cut, n) == (text, full)
    else:
        assert n <= budget and n == meter.count(prompt.build_messages(cut, opts))
        assert cut.endswith("|") and n >= budget - 3
    with pytest.raises(ValueError, match="no room"):
        prompt.fit_document(meter, text + "y", opts, empty + MAX_TOKENS - 1)


def test_fitted_prompt_records_what_it_does_not_send(capsys):
    opts = prompt.ExtractOptions(schema=SCHEMA, max_tokens=MAX_TOKENS, on_long="skip")
    doc = Document("d", "d.txt", "x" * 2000)
    rec = prompt.fitted_prompt(doc, opts, ShiftyMeter(), 1000)
    assert rec["error"].startswith("document too long") and not rec["valid"]
    assert "d: too long, skipped" in capsys.readouterr().err
    messages, truncated = prompt.fitted_prompt(
        doc, dataclasses.replace(opts, on_long="truncate"), ShiftyMeter(), 1000)
    assert truncated and messages[1]["content"].endswith("|")
