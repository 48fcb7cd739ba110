"""`formwork extract --server` against the real `formwork serve` (default model,
one server for the module) through the official openai client."""
from __future__ import annotations

import json

import jsonschema
import pytest

from gateway import extract
from test_extract import DOCS as BASE_DOCS
from test_extract import MAX_MODEL_LEN, SCHEMA, parse
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
def test_extract_through_server(server_url, setup):
    schema, docs, out = setup
    (docs / "long.txt").write_text("Jane Doe lives in Paris. " * 200)   # > the server's context
    rc = extract.run(parse("--schema", str(schema), str(docs), "-o", str(out), "-q",
                           "--server", server_url, "--api-key", KEY, "--max-tokens", "40",
                           "--concurrency", "2"))
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == sorted([*DOCS, "long.txt"])
    long = records.pop("long.txt")
    assert rc == 1 and long["valid"] is False and long["finish_reason"] is None
    assert long["error"].startswith("server error 400") and "context length" in long["error"]
    for r in records.values():
        if r["valid"]:
            jsonschema.validate(r["data"], SCHEMA)
            assert r["finish_reason"] == "stop" and r["usage"]["completion_tokens"] > 0
        else:
            assert r["error"], r
    assert any(r["valid"] for r in records.values()), records


@pytest.mark.slow
def test_server_refusals(server_url, setup, capsys):
    schema, docs, out = setup
    common = ("--schema", str(schema), str(docs), "-o", str(out), "-q", "--server", server_url)
    # the model list is refused: a setup error, nothing written
    assert extract.run(parse(*common, "--api-key", "wrong")) == 2
    assert "cannot list its models" in capsys.readouterr().err and not out.exists()
    # each request refused: every document recorded as failed
    rc = extract.run(parse(*common, "--api-key", "wrong", "--server-model", "any"))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert rc == 1 and sorted(r["id"] for r in records) == sorted(DOCS)
    assert all(r["error"].startswith("server error 401") and not r["valid"] for r in records)
    assert f"{len(DOCS)} documents: 0 ok, 0 invalid, {len(DOCS)} failed" in capsys.readouterr().err


def test_unreachable_server_is_a_setup_error(setup, capsys):
    schema, docs, out = setup
    rc = extract.run(parse("--schema", str(schema), str(docs), "-o", str(out), "-q",
                           "--server", f"http://127.0.0.1:{free_port()}", "--timeout", "5"))
    assert rc == 2 and "cannot list its models" in capsys.readouterr().err
    assert not out.exists()
