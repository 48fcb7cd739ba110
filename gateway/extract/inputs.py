"""The inputs of `formwork extract` (gateway/extract/cli.py is the command): the
schema (JSON file or pydantic model, checked) and the documents (files, folders,
JSONL, stdin). Every problem with them is a UsageError, raised before any model
is loaded.
"""
from __future__ import annotations

import codecs
import importlib
import importlib.util
import json
import os
import pathlib
import sys
from dataclasses import dataclass
from typing import Any

import jsonschema

from formwork.grammar.selection import validate_params
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
    return load_schema_and_model(spec)[0]


def load_schema_and_model(spec: str) -> tuple[dict, Any]:
    """`load_schema`'s schema, and the pydantic model it came from (None for a JSON
    file or a dict): records are then also checked with the model's own validators,
    which hold more than its JSON Schema says (an HttpUrl's scheme, a field_validator)."""
    model = None
    if os.path.isfile(spec):
        try:
            schema = json.loads(pathlib.Path(spec).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UsageError(f"--schema {spec}: not a readable JSON file: {e}") from None
    elif ":" in spec:
        schema, model = _schema_from_python(spec)
    else:
        raise UsageError(f"--schema {spec}: no such file (give a JSON Schema file, "
                         "module:Model or path/to/file.py:Model)")
    check_schema(schema, spec)
    return schema, model


def _schema_from_python(spec: str) -> tuple[dict, Any]:
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
        return obj, None
    if not hasattr(obj, "model_json_schema"):
        raise UsageError(f"--schema {spec}: {attr} is neither a pydantic model nor a dict")
    return obj.model_json_schema(), obj


def json_path(parts) -> str:
    """A location (keys and indices) as `$.a[0].b`."""
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def check_schema(schema, where: str = "schema") -> None:
    """Meta-schema check, then the engine's own check of what it can enforce."""
    if not isinstance(schema, dict):
        raise UsageError(f"--schema {where}: a JSON Schema must be an object, "
                         f"got {type(schema).__name__}")
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        at = json_path(e.absolute_path)
        raise UsageError(f"--schema {where}: invalid JSON Schema at {at}: {e.message}") from None
    try:
        validate_params(StructuredOutputsParams(json=schema))
    except ValueError as e:
        raise UsageError(f"--schema {where}: {e}") from None


# -- inputs ---------------------------------------------------------------
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
         (codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"),
         (codecs.BOM_UTF16_BE, "utf-16"))     # UTF-32 LE first: its BOM starts with UTF-16 LE's


def decode_text(data: bytes) -> tuple[str | None, str | None]:
    """(text, None), or (None, why) for bytes that are not a text document.

    A byte-order mark names the encoding (UTF-8/16/32; the mark is dropped);
    otherwise UTF-8, and bytes that are not UTF-8 are read as Windows-1252 (a
    superset of Latin-1 for text: the encoding of most non-UTF-8 text files), so
    that "M\xfcller" is "Müller" and not "M\ufffdller". A NUL byte outside a BOM'd
    UTF-16/32 file means a binary file (PDF, image, archive...): refused rather than
    sent to the model as garbage. The standard library's codecs do the work: a
    charset detector (chardet and co.) would guess among many more encodings from
    statistics, which is no more certain for short documents."""
    for bom, enc in _BOMS:
        if data.startswith(bom):
            try:
                return data.decode(enc), None
            except UnicodeDecodeError as e:
                return None, f"not valid {enc.upper().removesuffix('-SIG')} text after its byte-order mark: {e.reason}"
    if b"\x00" in data:
        return None, "binary file (it has NUL bytes), not a text document"
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        pass
    try:
        return data.decode("cp1252"), None
    except UnicodeDecodeError:               # the 5 bytes cp1252 leaves undefined
        return data.decode("latin-1"), None


def _check_text(doc_id: str, source: str, text: str) -> Document:
    if not text.strip():
        return Document(doc_id, source, None, "empty document: nothing to extract")
    return Document(doc_id, source, text)


def _read(path: pathlib.Path, doc_id: str) -> Document:
    try:
        data = path.read_bytes()
    except OSError as e:
        return Document(doc_id, str(path), None, f"cannot read {path}: {e.strerror or e}")
    text, why = decode_text(data)
    if text is None:
        return Document(doc_id, str(path), None, f"{path}: {why}")
    return _check_text(doc_id, str(path), text)


def _stdin(stream) -> Document:
    """stdin as one document: its bytes decoded as a file's are (not by the locale's
    codec, which would fail on the first non-UTF-8 byte); a text stream as it is."""
    raw = getattr(stream, "buffer", None)
    if raw is None:
        return _check_text("stdin", "-", stream.read())
    text, why = decode_text(raw.read())
    return Document("stdin", "-", None, f"stdin: {why}") if text is None \
        else _check_text("stdin", "-", text)


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
            if isinstance(text, str):
                docs.append(_check_text(doc_id, source, text))
            else:
                docs.append(Document(doc_id, source, None,
                                     f"line {n} has no string field {text_field!r}"))
    return docs


def collect_documents(inputs: list[str], *, globs=DEFAULT_GLOBS, text_field: str = "text",
                      id_field: str | None = None, stdin=None) -> list[Document]:
    """Documents of every input, in order; raises UsageError for a missing input,
    duplicate ids or no documents at all."""
    docs: list[Document] = []
    for arg in inputs:
        path = pathlib.Path(arg)
        if arg == "-":
            docs.append(_stdin(stdin or sys.stdin))
        elif path.is_dir():
            # a link to nothing is a document that cannot be read (recorded), not no document
            found = sorted({p for g in globs for p in path.rglob(g)
                            if p.is_file() or p.is_symlink() and not p.exists()})
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

