"""`formwork extract` end to end on the real default model.

Generation tests share one in-process LLM (through `run(args, llm=...)`);
two tests run the real CLI in a subprocess. Greedy SmolLM2-135M can loop, so
the schemas are bounded and a "length" record is accepted as long as it is
reported invalid; every test needs at least one valid record, so it cannot
pass vacuously, and every valid record is re-checked with jsonschema.
"""
from __future__ import annotations

import argparse
import codecs
import io
import json
import os
import pathlib
import subprocess
import sys

import jsonschema
import pytest

import formwork.gateway.llm
from formwork.gateway.extract import cli as extract_cli
from formwork.gateway.extract.inputs import (Document, UsageError, collect_documents, decode_text,
                                             load_schema, load_schema_and_model)
from formwork.gateway.extract.records import judge, make_validator

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 30},
                   "city": {"type": "string", "maxLength": 20}},
    "required": ["name", "city"],
    "additionalProperties": False,
}
DOCS = {
    "a.txt": "Jane Doe lives in Paris. She works as a baker.",
    "notes/b.md": "# Visitor\nCarlos Ruiz came from Madrid to see the museum.",
}
MAX_MODEL_LEN = 512
MAX_TOKENS = 40
MODEL_FILE = '''from pydantic import BaseModel, Field


class Person(BaseModel):
    name: str = Field(max_length=30)
    city: str = Field(max_length=20)
'''


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    extract_cli.add_arguments(p)
    return p.parse_args(list(argv))


def write_tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def read_records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_records(records: list[dict], schema: dict, ids: set[str]) -> None:
    """Every document present once; valid ones validate; invalid ones say why."""
    assert sorted(r["id"] for r in records) == sorted(ids)
    for r in records:
        assert set(r) == {"id", "source", "data", "valid", "finish_reason", "error", "usage",
                          "truncated"}
        if r["valid"]:
            jsonschema.validate(r["data"], schema)
            assert r["finish_reason"] == "stop" and r["error"] is None
            assert r["usage"]["completion_tokens"] > 0 and r["usage"]["prompt_tokens"] > 0
        else:
            assert r["error"], r
    assert any(r["valid"] for r in records), records


@pytest.fixture
def schema_file(tmp_path) -> pathlib.Path:
    path = tmp_path / "person.json"
    path.write_text(json.dumps(SCHEMA))
    return path


def cli_args(schema_file, docs, out) -> tuple[str, ...]:
    return ("--schema", str(schema_file), str(docs), "-o", str(out), "--max-tokens",
            str(MAX_TOKENS), "--quiet")


class NoModel:
    """Stands in for gateway.llm.LLM where a test proves no model is loaded."""

    def __init__(self, *a, **k):
        raise AssertionError("the model was loaded")


# -- no model ----------------------------------------------------------------
@pytest.mark.parametrize("schema_text, expected", [
    ('{"type": "object", "properties": {"n": {"type": "strin"}}}',
     "invalid JSON Schema at $.properties.n.type"),
    ('{"type": "object", "properties": {"n": {"maxLength": -1}}}',
     "invalid JSON Schema at $.properties.n.maxLength"),
    ('{"type": "object",', "not a readable JSON file"),
    ('[1, 2]', "a JSON Schema must be an object"),
    ('{"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "object"},'
     ' "uniqueItems": true}}}',                                   # valid, but not enforceable
     "unsupported JSON Schema keyword 'uniqueItems' at $.properties.tags"),
])
def test_bad_schema_is_a_usage_error_before_any_model(tmp_path, monkeypatch, capsys,
                                                     schema_text, expected):
    monkeypatch.setattr(formwork.gateway.llm, "LLM", NoModel)
    (tmp_path / "s.json").write_text(schema_text)
    write_tree(tmp_path / "docs", DOCS)
    out = tmp_path / "out.jsonl"
    rc = extract_cli.run(parse("--schema", str(tmp_path / "s.json"), str(tmp_path / "docs"),
                           "-o", str(out)))
    assert rc == 2
    err = capsys.readouterr().err
    assert expected in err and "formwork extract: error:" in err
    assert not out.exists()


def test_max_tokens_past_a_given_context_is_a_usage_error_before_any_model(tmp_path, monkeypatch,
                                                                          capsys, schema_file):
    """--max-model-len on the command line: --max-tokens that leaves no room for a
    prompt is refused before the model loads (it was found only after loading)."""
    monkeypatch.setattr(formwork.gateway.llm, "LLM", NoModel)
    write_tree(tmp_path / "docs", DOCS)
    rc = extract_cli.run(parse("--schema", str(schema_file), str(tmp_path / "docs"),
                               "--max-model-len", "512"))           # --max-tokens: 512
    assert rc == 2
    assert "--max-tokens 512 leaves no room for a prompt: max_model_len is 512" in \
        capsys.readouterr().err


def test_bad_pydantic_reference_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(formwork.gateway.llm, "LLM", NoModel)
    (tmp_path / "m.py").write_text(MODEL_FILE)
    write_tree(tmp_path / "docs", DOCS)
    for spec, expected in ((f"{tmp_path}/m.py:Nobody", "AttributeError"),
                           (f"{tmp_path}/missing.py:Person", "no such file"),
                           ("no_such_module_xyz:Person", "ModuleNotFoundError")):
        assert extract_cli.run(parse("--schema", spec, str(tmp_path / "docs"))) == 2
        assert expected in capsys.readouterr().err


def test_example_schemas_load_and_agree():
    """The shipped examples pass every check, and the pydantic contact model
    demands what contact.json demands."""
    load_schema(str(ROOT / "examples/schemas/invoice.json"))
    js = load_schema(str(ROOT / "examples/schemas/contact.json"))
    py = load_schema(str(ROOT / "examples/schemas/contact_model.py:Contact"))
    assert sorted(js["required"]) == sorted(py["required"])
    for name, prop in js["properties"].items():
        assert prop.get("maxLength") == py["properties"][name].get("maxLength")
        assert prop.get("enum") == py["properties"][name].get("enum")
    sample = {"name": "A", "email": "a@b.c", "phone": "1", "company": "C", "role": "R",
              "preferred_channel": "phone"}
    for bad in ({**sample, "preferred_channel": "fax"}, {**sample, "extra": 1}, {"name": "A"}):
        for schema in (js, py):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad, schema)
    jsonschema.validate(sample, js)
    jsonschema.validate(sample, py)


def test_cli_bad_schema_exits_2(tmp_path):
    """The real `formwork extract` entry point: message on stderr, status 2, no output."""
    (tmp_path / "s.json").write_text('{"type": "objekt"}')
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "formwork.gateway.cli", "extract", "--schema", str(tmp_path / "s.json"),
         str(ROOT / "examples/docs/contacts"), "-o", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "invalid JSON Schema at $.type" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_collect_documents(tmp_path):
    write_tree(tmp_path / "docs", {**DOCS, "skip.csv": "x", "deep/er/c.txt": "C"})
    jl = tmp_path / "in.jsonl"
    jl.write_text('{"text": "one", "key": 7}\n\n{"body": "no text"}\nnot json\n{"text": "two"}\n')
    docs = collect_documents([str(tmp_path / "docs"), str(jl), "-"], id_field="key",
                             stdin=io.StringIO("from stdin"))
    assert [d.id for d in docs] == ["a.txt", "deep/er/c.txt", "notes/b.md", "7",
                                    f"{jl}:3", f"{jl}:4", f"{jl}:5", "stdin"]
    by_id = {d.id: d for d in docs}
    assert by_id["notes/b.md"].text == DOCS["notes/b.md"]
    assert by_id["7"].text == "one" and by_id[f"{jl}:5"].text == "two"
    assert by_id[f"{jl}:3"].text is None and "no string field 'text'" in by_id[f"{jl}:3"].error
    assert "not valid JSON" in by_id[f"{jl}:4"].error
    assert by_id["stdin"].text == "from stdin"
    only_md = collect_documents([str(tmp_path / "docs")], globs=("*.md",))
    assert [d.id for d in only_md] == ["notes/b.md"]
    with pytest.raises(UsageError, match="duplicate document id 'a.txt'"):
        collect_documents([str(tmp_path / "docs"), str(tmp_path / "docs")])
    with pytest.raises(UsageError, match="no documents"):
        collect_documents([str(tmp_path / "docs")], globs=("*.pdf",))


@pytest.mark.parametrize("data, text", [
    ("Müller GmbH, 5 €".encode("utf-8"), "Müller GmbH, 5 €"),
    ("Müller GmbH, 5 €".encode("cp1252"), "Müller GmbH, 5 €"),      # not UTF-8: Windows-1252
    (b"M\xfcller \x81", "Müller \x81"),                            # a byte cp1252 leaves undefined
    (codecs.BOM_UTF8 + "Zoë".encode("utf-8"), "Zoë"),               # the mark is dropped
    ("Zoë 日本".encode("utf-16"), "Zoë 日本"),                        # BOM'd UTF-16 (has NUL bytes)
    (codecs.BOM_UTF16_BE + "Zoë".encode("utf-16-be"), "Zoë"),
    ("Zoë".encode("utf-32"), "Zoë"),
])
def test_decode_text(data, text):
    assert decode_text(data) == (text, None)


def test_documents_that_are_not_text_or_are_empty_are_recorded_not_sent(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "scan.txt").write_bytes(b"%PDF-1.7\n\x00\x01\x02binary")
    (d / "blank.txt").write_text(" \n\t\n")
    (d / "bad16.txt").write_bytes(codecs.BOM_UTF16_LE + b"\x00\xd8")   # a lone surrogate
    (d / "latin.txt").write_bytes("Rechnung von Müller".encode("latin-1"))
    (d / "gone.txt").symlink_to(tmp_path / "moved-away.txt")          # a link to nothing
    (d / "here.txt").symlink_to(d / "latin.txt")
    jl = tmp_path / "in.jsonl"
    jl.write_text('{"text": ""}\n{"text": "ok"}\n')
    docs = {x.id: x for x in collect_documents([str(d), str(jl)])}
    assert docs["scan.txt"].text is None and "binary file" in docs["scan.txt"].error
    assert docs["blank.txt"].text is None and docs["blank.txt"].error.startswith("empty document")
    assert docs["bad16.txt"].text is None and "UTF-16" in docs["bad16.txt"].error
    assert docs["latin.txt"].text == "Rechnung von Müller" and docs["latin.txt"].error is None
    assert docs["here.txt"].text == "Rechnung von Müller"
    assert docs["gone.txt"].text is None and "cannot read" in docs["gone.txt"].error
    assert docs[f"{jl}:1"].error.startswith("empty document") and docs[f"{jl}:2"].text == "ok"
    stdin = io.TextIOWrapper(io.BytesIO("Grüße".encode("cp1252")), encoding="ascii")
    assert collect_documents(["-"], stdin=stdin)[0].text == "Grüße"   # bytes, not the locale's codec
    empty = collect_documents(["-"], stdin=io.StringIO(""))[0]
    assert empty.text is None and empty.error.startswith("empty document")


@pytest.mark.parametrize("text, finish, valid, error", [
    ('{"name": "A", "city": "B"}', "stop", True, None),
    ('{"name": "A"}', "stop", False, "schema violation at $: 'city' is a required property"),
    ('{"name": "A", "city": "' + "x" * 21 + '"}', "stop", False, "schema violation at $.city"),
    ('{"name": "A", "ci', "length", False, "output cut at --max-tokens"),
    ('{"name": "A", "city": "B"}', "length", False, "output closed early to fit --max-tokens"),
    ('{"name": "A"}', "length", False, "output cut at --max-tokens"),
    ("{oops", "stop", False, "output is not valid JSON"),
])
def test_judge_matches_jsonschema(text, finish, valid, error):
    rec = judge(Document("d", "s", "t"), text, finish, make_validator(SCHEMA), usage=(5, 3))
    assert rec["valid"] is valid
    assert (rec["error"] is None) if error is None else error in rec["error"]
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    assert rec["data"] == data
    if valid:
        jsonschema.validate(rec["data"], SCHEMA)


PAGE_MODEL = '''from pydantic import BaseModel, Field, HttpUrl, field_validator


class Page(BaseModel):
    title: str = Field(max_length=30)
    url: HttpUrl

    @field_validator("title")
    @classmethod
    def capitalised(cls, v):
        if not v[:1].isupper():
            raise ValueError("must start with a capital letter")
        return v
'''


@pytest.mark.parametrize("text, error", [
    ('{"title": "Home", "url": "https://example.com/"}', None),
    ('{"title": "Home", "url": "ftp://example.com/"}', "Page refused it at $.url: URL scheme"),
    ('{"title": "home", "url": "https://example.com/"}',
     "Page refused it at $.title: Value error, must start with a capital letter"),
])
def test_a_pydantic_schema_is_also_judged_by_its_model(tmp_path, text, error):
    """--schema file.py:Model: the model's validators hold more than its JSON Schema
    (HttpUrl's scheme, a field_validator); a record the schema passes but the model
    refuses was "valid": true, and the user's Model.model_validate then failed."""
    (tmp_path / "page_model.py").write_text(PAGE_MODEL)
    schema, model = load_schema_and_model(f"{tmp_path}/page_model.py:Page")
    assert model.__name__ == "Page" and schema == model.model_json_schema()
    jsonschema.validate(json.loads(text), schema)                  # the schema alone passes
    rec = judge(Document("d", "s", "t"), text, "stop", make_validator(schema, model), usage=(5, 3))
    assert rec["valid"] is (error is None) and rec["data"] == json.loads(text)
    assert (rec["error"] is None) if error is None else rec["error"].startswith(error), rec["error"]
    assert load_schema_and_model(str(ROOT / "examples/schemas/contact.json"))[1] is None


def test_judge_refuses_numbers_a_json_line_cannot_carry():
    """`1e999` is valid JSON and passes the schema, but Python reads it as inf and
    the JSONL line said `Infinity`, which no JSON reader but Python's takes."""
    schema = {"type": "object", "properties": {"n": {"type": "number"}}}
    rec = judge(Document("d", "s", "t"), '{"n": -1e999}', "stop",
                make_validator(schema), usage=(5, 3))
    assert rec["valid"] is False and rec["data"] is None and "64-bit float" in rec["error"]
    json.loads(json.dumps(rec, allow_nan=False))
    ok = judge(Document("d", "s", "t"), '{"n": 1e308}', "stop", make_validator(schema), usage=(5, 3))
    assert ok["valid"] is True and ok["data"] == {"n": 1e308}


def test_records_stay_one_line_for_splitlines_readers(tmp_path):
    """A record whose data holds U+2028, U+0085 or U+2029 (JSON leaves them raw)
    was broken in two by readers that split lines with str.splitlines()."""
    from formwork.gateway.extract.records import RecordSink
    data = {"quote": "line\u2028next\x85end\u2029", "name": "Zoë"}
    sink = RecordSink(str(tmp_path / "out.jsonl"))
    sink.write({"id": "a", "data": data})
    sink.write({"id": "b", "data": None})
    sink.close()
    records = read_records(tmp_path / "out.jsonl")
    assert [r["id"] for r in records] == ["a", "b"] and records[0]["data"] == data


# -- the real model ----------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    from formwork.gateway.llm import LLM
    engine = LLM(max_model_len=MAX_MODEL_LEN, max_num_seqs=8)
    yield engine
    engine.shutdown()


@pytest.mark.slow
def test_folder_to_jsonl_then_resume(llm, tmp_path, schema_file, capsys):
    docs = write_tree(tmp_path / "docs", {**DOCS, "ignored.csv": "x"})
    out = tmp_path / "out.jsonl"
    args = cli_args(schema_file, docs, out)
    rc = extract_cli.run(parse(*args), llm=llm)
    records = read_records(out)
    check_records(records, SCHEMA, set(DOCS))
    assert rc == (0 if all(r["valid"] for r in records) else 1)
    assert {r["source"] for r in records} == {str(docs / n) for n in DOCS}
    assert "2 documents:" in capsys.readouterr().err

    before = out.read_text()
    assert extract_cli.run(parse(*args, "--resume"), llm=llm) == 0
    assert out.read_text() == before and "nothing to do" in capsys.readouterr().err

    (docs / "c.txt").write_text("Li Wei was born in Shanghai.")
    extract_cli.run(parse(*args, "--resume"), llm=llm)
    after = read_records(out)
    assert out.read_text().startswith(before) and len(after) == 3
    assert after[-1]["id"] == "c.txt"
    check_records(after, SCHEMA, set(DOCS) | {"c.txt"})


class InterruptAfterFirst:
    """Wraps the offline LLM: Ctrl-C arrives right after the first document finishes."""

    def __init__(self, llm):
        self._llm, self.engine, self.tokenizer = llm, llm.engine, llm.tokenizer
        self.finished = 0

    def chat(self, convs, params, *, on_finished, **kw):
        def hook(i, out):
            on_finished(i, out)
            self.finished += 1
            raise KeyboardInterrupt
        return self._llm.chat(convs, params, on_finished=hook, **kw)


@pytest.mark.slow
def test_interrupted_run_keeps_finished_records_and_resumes(llm, tmp_path, schema_file, capsys):
    docs = write_tree(tmp_path / "docs", {**DOCS, "c.txt": "Li Wei was born in Shanghai."})
    out = tmp_path / "out.jsonl"
    args = cli_args(schema_file, docs, out)
    wrapped = InterruptAfterFirst(llm)
    assert extract_cli.run(parse(*args), llm=wrapped) == 130
    assert "rerun with --resume" in capsys.readouterr().err
    first = read_records(out)
    assert wrapped.finished == 1 and len(first) == 1      # written before the others finished
    check_records(first, SCHEMA, {first[0]["id"]})
    # the aborted requests left nothing behind in the engine
    assert not llm.engine.has_unfinished_requests()
    stats = llm.get_stats()                 # the engine's own view, across the process boundary
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_free_blocks == stats.kv_total_blocks   # every block free or cached
    extract_cli.run(parse(*args, "--resume"), llm=llm)
    after = read_records(out)
    assert after[0] == first[0] and len(after) == 3
    check_records(after, SCHEMA, {"a.txt", "notes/b.md", "c.txt"})


@pytest.mark.slow
def test_pydantic_model_schema(llm, tmp_path):
    (tmp_path / "person_model.py").write_text(MODEL_FILE)
    docs = write_tree(tmp_path / "docs", DOCS)
    out = tmp_path / "out.jsonl"
    extract_cli.run(parse("--schema", f"{tmp_path}/person_model.py:Person", str(docs), "-o", str(out),
                      "--max-tokens", str(MAX_TOKENS), "-q"), llm=llm)
    records = read_records(out)
    sys.path.insert(0, str(tmp_path))
    try:
        from person_model import Person
    finally:
        sys.path.remove(str(tmp_path))
    check_records(records, Person.model_json_schema(), set(DOCS))
    for r in records:
        if r["valid"]:
            assert Person.model_validate(r["data"]).name == r["data"]["name"]


@pytest.mark.slow
def test_too_long_document_is_truncated_or_skipped(llm, tmp_path, schema_file, capsys):
    long_text = "Jane Doe lives in Paris. " + "She bakes bread every morning. " * 150
    docs = write_tree(tmp_path / "docs", {"long.txt": long_text, **DOCS})
    out = tmp_path / "out.jsonl"
    extract_cli.run(parse("--schema", str(schema_file), str(docs), "-o", str(out),
                      "--max-tokens", str(MAX_TOKENS), "-q"), llm=llm)
    assert "long.txt: too long, truncated" in capsys.readouterr().err
    records = {r["id"]: r for r in read_records(out)}
    check_records(list(records.values()), SCHEMA, {"long.txt", *DOCS})
    long = records["long.txt"]
    assert long["truncated"] is True and long["finish_reason"] in ("stop", "length")
    assert long["usage"]["prompt_tokens"] + MAX_TOKENS <= MAX_MODEL_LEN
    assert long["usage"]["prompt_tokens"] > MAX_MODEL_LEN - MAX_TOKENS - 16  # cut to fill the room
    assert not any(records[d]["truncated"] for d in DOCS)

    skip = ("--schema", str(schema_file), str(docs / "long.txt"), "-o", str(out), "-q")
    assert extract_cli.run(parse(*skip, "--on-long", "skip"), llm=llm) == 2   # 512 tokens: no room
    assert "--max-tokens 512 leaves no room" in capsys.readouterr().err
    rc = extract_cli.run(parse(*skip, "--on-long", "skip", "--max-tokens", str(MAX_TOKENS)), llm=llm)
    (rec,) = read_records(out)
    assert rc == 1 and rec["valid"] is False and rec["finish_reason"] is None
    assert "skipped (--on-long skip)" in rec["error"] and rec["usage"]["completion_tokens"] == 0


@pytest.mark.slow
def test_cli_stdin_to_stdout(schema_file):
    """The real console entry point: one document on stdin, one record on stdout."""
    proc = subprocess.run(
        [sys.executable, "-m", "formwork.gateway.cli", "extract", "--schema", str(schema_file), "-",
         "--max-tokens", str(MAX_TOKENS), "--max-model-len", str(MAX_MODEL_LEN),
         "--allow-failures"],
        input=DOCS["a.txt"], cwd=ROOT, capture_output=True, text=True, timeout=1200,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()
    rec = json.loads(line)
    assert rec["id"] == "stdin" and rec["source"] == "-"
    assert rec["valid"], rec
    jsonschema.validate(rec["data"], SCHEMA)
    assert "1 document: 1 ok" in proc.stderr
