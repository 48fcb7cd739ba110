"""What every OpenAI-protocol model shares (chat, completions, the Responses API,
the tokenizer endpoints): the request and response base classes with their body
checks, ids, model cards and the error body. Pydantic, the HTTP wire format only.
"""
from __future__ import annotations

import functools
import time
import types
import typing
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from formwork.schemas.errors import ParamError

# Deeper request bodies are refused before any validation: no real request comes
# near it (a JSON schema nested 60 levels is still < 128), and recursive walkers
# after parsing (validation, schema compilers) would hit Python's recursion limit.
MAX_BODY_DEPTH = 128


def random_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


class InvalidBodyError(ValueError):
    """The body as a whole cannot be taken (not a field's value): 400 invalid_json."""


def _check_body(value: Any, path: str = "", depth: int = 0) -> None:
    """Refuses a body nested deeper than MAX_BODY_DEPTH and strings with a lone
    surrogate (JSON's "\\ud800" decodes to a str no tokenizer or encoder takes)."""
    if isinstance(value, str):
        if any(0xD800 <= ord(c) <= 0xDFFF for c in value):
            raise ParamError(path or "body",
                                  "contains a lone UTF-16 surrogate (not valid Unicode text)")
        return
    if isinstance(value, (dict, list)) and depth >= MAX_BODY_DEPTH:
        field = path.split(".")[0].split("[")[0]
        raise InvalidBodyError(f"the body is nested more than {MAX_BODY_DEPTH} levels deep "
                               f"(in `{field}`)")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_body(k, path, depth + 1)
            _check_body(v, f"{path}.{k}" if path else str(k), depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_body(v, f"{path}[{i}]", depth + 1)


def _admits_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    if typing.get_origin(annotation) is typing.Annotated:
        return _admits_none(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_admits_none(a) for a in typing.get_args(annotation))
    return False


class RequestModel(BaseModel):
    # allow_inf_nan=False: NaN / Infinity are not numbers any parameter accepts
    model_config = ConfigDict(extra="ignore", populate_by_name=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data: Any) -> Any:
        _check_body(data)
        return data

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """A null optional field is the field left out (OpenAI's API types most of
        them nullable; clients generated from it send nulls): it takes its default,
        also where the type itself has no null (`n`, `stream`, `logprobs`...).
        Required fields stay refused when null."""
        if isinstance(data, dict):
            unset = cls._defaulted_not_nullable()
            if any(v is None and k in unset for k, v in data.items()):
                return {k: v for k, v in data.items() if v is not None or k not in unset}
        return data

    @classmethod
    @functools.cache
    def _defaulted_not_nullable(cls) -> frozenset[str]:
        """Names (and aliases) of the fields with a default whose type has no null."""
        names = set()
        for name, info in cls.model_fields.items():
            if not info.is_required() and not _admits_none(info.annotation):
                names.add(name)
                if info.alias:
                    names.add(info.alias)
        return frozenset(names)


class ResponseModel(BaseModel):
    model_config = ConfigDict(populate_by_name=True)


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "formwork"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo
