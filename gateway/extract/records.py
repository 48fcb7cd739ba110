"""The JSONL records of `formwork extract`: one per document, parsed and
validated against the schema (`judge`), counted (`Summary`), written line by
line (`RecordSink`) and read back for --resume (`done_ids`).
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass

import jsonschema

from formwork.gateway.extract.inputs import Document, json_path
from formwork.gateway.json_lines import dumps_line


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
    Valid only when it also finished with "stop" (a "length" output that parses and
    validates was closed early by budget-aware decoding: its data is kept, flagged
    as possibly incomplete); `error` (engine or server) wins."""
    rec = dict(finish_reason=finish_reason, usage=usage, truncated=truncated)
    if error is not None:
        return make_record(doc, error=error, **rec)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        data, error = None, f"output is not valid JSON ({e.msg} at char {e.pos}): {text[:120]!r}"
    else:
        if _has_non_finite(data):       # 1e999: valid JSON, but written back as `Infinity`
            data, error = None, ("output has a number beyond what a 64-bit float holds "
                                 f"(read as infinity; a JSON line cannot carry it): {text[:120]!r}")
        best = None if error else jsonschema.exceptions.best_match(validator.iter_errors(data))
        if best is not None:
            error = f"schema violation at {best.json_path}: {best.message}"
        elif error is None:
            error = validator.model_error(data)
    if finish_reason == "length" and error is None:
        # budget-aware decoding closed it: complete and schema-valid, but what the
        # model would have written next (another item, a longer value) is missing
        error = (f"output closed early to fit --max-tokens ({usage[1]} tokens): the record "
                 "is schema-valid but may be incomplete; raise --max-tokens")
    elif finish_reason == "length":
        error = (f"output cut at --max-tokens ({usage[1]} tokens) before the JSON was complete; "
                 "raise --max-tokens or bound the schema (maxLength, maxItems)")
    elif finish_reason != "stop" and error is None:
        error = f"generation ended with finish_reason {finish_reason!r}"
    return make_record(doc, data=data, valid=error is None, error=error, **rec)


def _has_non_finite(value) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_non_finite(v) for v in value)
    return False


class RecordValidator:
    """The schema's jsonschema validator and, when --schema named a pydantic model,
    that model: a record is valid only when both accept it. A model holds more than
    its JSON Schema says (an HttpUrl's http/https scheme, an IPv4Network's zero host
    bits, a field_validator), and the user's next step is `Model.model_validate`."""

    def __init__(self, schema: dict, model=None) -> None:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        self._schema, self.model = cls(schema), model

    def iter_errors(self, data):
        return self._schema.iter_errors(data)

    def model_error(self, data) -> str | None:
        if self.model is None:
            return None
        try:
            self.model.model_validate(data)
        except Exception as e:      # pydantic's ValidationError, or the user's own code's
            errors = e.errors() if callable(getattr(e, "errors", None)) else []
            first = errors[0] if errors else None
            where = json_path(first["loc"]) if first else "$"
            what = first["msg"] if first else f"{type(e).__name__}: {e}"
            return f"{self.model.__name__} refused it at {where}: {what}"
        return None


def make_validator(schema: dict, model=None) -> RecordValidator:
    return RecordValidator(schema, model)


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
        self._f.write(dumps_line(rec) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None and self._f is not sys.stdout:
            self._f.close()
