"""Inputs and outputs of `formwork extract` (see gateway/extract.py): the schema
(JSON file or pydantic model, checked), the documents (files, folders, JSONL,
stdin), and the JSONL records (parsed, validated, summarised, resumed).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pathlib
import sys
from dataclasses import dataclass

import jsonschema

from formwork.schemas.structured import StructuredOutputsParams

DEFAULT_GLOBS = ("*.txt", "*.md")


class UsageError(ValueError):
    """Bad arguments, inputs or schema: exit status 2, nothing generated."""


@dataclass(frozen=True, slots=True)
class Document:
    id: str
    source: str
    text: str | None            # None when the input could not be read (`error` says why)
    error: str | None = None


# -- schema ---------------------------------------------------------------
def load_schema(spec: str) -> dict:
    """The JSON Schema named by `spec` (a .json file, `module:Model` or
    `path/file.py:Model`), checked; raises UsageError saying what is wrong."""
    if os.path.isfile(spec):
        try:
            schema = json.loads(pathlib.Path(spec).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UsageError(f"--schema {spec}: not a readable JSON file: {e}") from None
    elif ":" in spec:
        schema = _schema_from_python(spec)
    else:
        raise UsageError(f"--schema {spec}: no such file (give a JSON Schema file, "
                         "module:Model or path/to/file.py:Model)")
    check_schema(schema, spec)
    return schema


def _schema_from_python(spec: str) -> dict:
    target, _, attr = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            if not os.path.isfile(target):
                raise UsageError(f"--schema {spec}: no such file {target}")
            name = f"_formwork_schema_{pathlib.Path(target).stem}"
            mod_spec = importlib.util.spec_from_file_location(name, target)
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[name] = module          # pydantic resolves annotations through it
            mod_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(target)
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except UsageError:
        raise
    except Exception as e:  # user code: any failure to import it is a usage error
        raise UsageError(f"--schema {spec}: cannot load it: {type(e).__name__}: {e}") from None
    if isinstance(obj, dict):
        return obj
    if not hasattr(obj, "model_json_schema"):
        raise UsageError(f"--schema {spec}: {attr} is neither a pydantic model nor a dict")
    return obj.model_json_schema()


def check_schema(schema, where: str = "schema") -> None:
    """Meta-schema check, then the engine's own check of what it can enforce."""
    if not isinstance(schema, dict):
        raise UsageError(f"--schema {where}: a JSON Schema must be an object, "
                         f"got {type(schema).__name__}")
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        at = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
        raise UsageError(f"--schema {where}: invalid JSON Schema at {at}: {e.message}") from None
    from formwork.core.validation import validate_structured  # pulls in grammar backends: lazily
    try:
        validate_structured(StructuredOutputsParams(json=schema))
    except ValueError as e:
        raise UsageError(f"--schema {where}: {e}") from None


# -- inputs ---------------------------------------------------------------
def _read(path: pathlib.Path, doc_id: str) -> Document:
    try:
        return Document(doc_id, str(path), path.read_bytes().decode("utf-8", errors="replace"))
    except OSError as e:
        return Document(doc_id, str(path), None, f"cannot read {path}: {e.strerror or e}")


def _jsonl(path: str, text_field: str, id_field: str | None) -> list[Document]:
    docs = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            source = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                docs.append(Document(source, source, None, f"line {n} is not valid JSON: {e}"))
                continue
            obj = obj if isinstance(obj, dict) else {}
            doc_id = str(obj[id_field]) if id_field and obj.get(id_field) is not None else source
            text = obj.get(text_field)
            error = None if isinstance(text, str) else f"line {n} has no string field {text_field!r}"
            docs.append(Document(doc_id, source, text if error is None else None, error))
    return docs


def collect_documents(inputs: list[str], *, globs=DEFAULT_GLOBS, text_field: str = "text",
                      id_field: str | None = None, stdin=None) -> list[Document]:
    """Documents of every input, in order; raises UsageError for a missing input,
    duplicate ids or no documents at all."""
    docs: list[Document] = []
    for arg in inputs:
        path = pathlib.Path(arg)
        if arg == "-":
            docs.append(Document("stdin", "-", (stdin or sys.stdin).read()))
        elif path.is_dir():
            found = sorted({p for g in globs for p in path.rglob(g) if p.is_file()})
            docs += [_read(p, p.relative_to(path).as_posix()) for p in found]
        elif path.is_file() and path.suffix == ".jsonl":
            docs += _jsonl(arg, text_field, id_field)
        elif path.is_file():
            docs.append(_read(path, path.as_posix()))
        else:
            raise UsageError(f"{arg}: no such file or folder")
    seen: set[str] = set()
    for d in docs:
        if d.id in seen:
            raise UsageError(f"duplicate document id {d.id!r} (source {d.source}); ids must be "
                             "unique for --resume: pass each input once, or fix --id-field")
        seen.add(d.id)
    if not docs:
        raise UsageError(f"no documents in {' '.join(inputs)} (folders are searched "
                         f"recursively for {', '.join(globs)}; see --glob)")
    return docs


# -- records ----------------------------------------------------------
def make_record(doc: Document, *, data=None, valid: bool = False, finish_reason=None,
                error: str | None = None, usage: tuple[int, int] = (0, 0),
                truncated: bool = False) -> dict:
    return {"id": doc.id, "source": doc.source, "data": data, "valid": valid,
            "finish_reason": finish_reason, "error": error,
            "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1]},
            "truncated": truncated}


def judge(doc: Document, text: str, finish_reason: str | None, validator, *,
          usage: tuple[int, int], truncated: bool = False, error: str | None = None) -> dict:
    """The record of one generated output: parsed, then validated against the schema.
    Valid only when it also finished with "stop"; `error` (engine or server) wins."""
    rec = dict(finish_reason=finish_reason, usage=usage, truncated=truncated)
    if error is not None:
        return make_record(doc, error=error, **rec)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        data, error = None, f"output is not valid JSON ({e.msg} at char {e.pos}): {text[:120]!r}"
    else:
        best = jsonschema.exceptions.best_match(validator.iter_errors(data))
        if best is not None:
            error = f"schema violation at {best.json_path}: {best.message}"
    if finish_reason == "length":
        error = (f"output cut at --max-tokens ({usage[1]} tokens) before the JSON was complete; "
                 "raise --max-tokens or bound the schema (maxLength, maxItems)")
    elif finish_reason != "stop" and error is None:
        error = f"generation ended with finish_reason {finish_reason!r}"
    return make_record(doc, data=data, valid=error is None, error=error, **rec)


def make_validator(schema: dict):
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)


@dataclass(slots=True)
class Summary:
    ok: int = 0
    invalid: int = 0            # the model answered, but not with a valid, complete object
    failed: int = 0             # no answer: unreadable input, skipped, engine or server error
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, rec: dict) -> None:
        if rec["valid"]:
            self.ok += 1
        elif rec["finish_reason"] in ("stop", "length"):
            self.invalid += 1
        else:
            self.failed += 1
        self.prompt_tokens += rec["usage"]["prompt_tokens"]
        self.completion_tokens += rec["usage"]["completion_tokens"]

    def line(self, seconds: float) -> str:
        n = self.ok + self.invalid + self.failed
        s = max(seconds, 1e-9)
        return (f"{n} document{'' if n == 1 else 's'}: {self.ok} ok, {self.invalid} invalid, {self.failed} failed "
                f"in {seconds:.1f} s ({n / s:.2f} docs/s; {self.prompt_tokens} prompt + "
                f"{self.completion_tokens} completion tokens, {self.completion_tokens / s:.1f} "
                f"completion tok/s)")


# -- output file ----------------------------------------------------------
def done_ids(path: str) -> set[str]:
    """Ids already recorded in the JSONL file `path` (none if it does not exist);
    a line that does not parse (a run killed mid-write) is ignored."""
    ids: set[str] = set()
    if not os.path.exists(path):
        return ids
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                ids.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return ids


def _drop_partial_line(path: str) -> None:
    """Cut a last line without its newline (a run killed mid-write) off `path`."""
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


class RecordSink:
    """Writes records as JSON lines to `path` (appending with `append`) or stdout,
    flushed line by line so that a killed run keeps what it finished."""

    def __init__(self, path: str | None, append: bool = False):
        self.path, self.append = path, append
        self._f = None                 # opened at the first record: an early error leaves OUT alone

    def _open(self):
        if self.path is None:
            return sys.stdout
        if self.append and os.path.exists(self.path):
            _drop_partial_line(self.path)
        return open(self.path, "a" if self.append else "w", encoding="utf-8")

    def write(self, rec: dict) -> None:
        if self._f is None:
            self._f = self._open()
        self._f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None and self._f is not sys.stdout:
            self._f.close()
