"""Catch the warnings xgrammar's C++ core prints while converting a constraint.

xgrammar reports parts of a JSON Schema or regex it does not enforce
("... ignoring minLength/maxLength", "Lookahead assertion ... is ignored",
"falling back to anyOf semantics") only as log lines on file descriptor 2.
A constraint that is silently weakened would break the guarantee that a
finished output validates, so conversions run with fd 2 redirected into a
temporary file and every warning becomes a rejection.

Contract: conversions are serialized by a process-wide lock (they take
milliseconds); lines other threads write to fd 2 meanwhile are copied back
to the real stderr afterwards.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
_LOCK = threading.Lock()
# "[14:34:31] /project/cpp/json_schema_converter.cc:1199: Warning: <text>"
_WARNING = re.compile(r"^\[[\d:]+\] \S+\.cc:\d+: Warning: (.*)$")


def call_capturing_warnings(fn: Callable[[], T]) -> tuple[T, list[str]]:
    """Run `fn()`; return its result and the distinct native warnings it printed.
    Exceptions from `fn` propagate (after fd 2 is restored)."""
    with _LOCK, tempfile.TemporaryFile() as sink:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            result = fn()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode("utf-8", "replace")
    warnings: list[str] = []
    other: list[str] = []
    for line in text.splitlines():
        m = _WARNING.match(line)
        if m is None:
            other.append(line)
        elif m.group(1) not in warnings:
            warnings.append(m.group(1))
    if other:
        sys.stderr.write("\n".join(other) + "\n")
    return result, warnings
