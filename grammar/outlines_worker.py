"""Run outlines-core's heavy calls in a child process that can be killed.

Neither `build_regex_from_schema` nor an `Index` build can be interrupted
in-process, and their time and memory are hard to predict (17 optional
properties made the regex builder exhaust 3 GB; a `format: uri` string inside
an array of objects built its Index for over 13 minutes). The child gets a
memory cap and the caller a deadline. Imports only outlines-core: the child
starts in a fresh interpreter (spawn).
"""
from __future__ import annotations

import multiprocessing
import pickle
import resource

import outlines_core as oc

CHILD_MEMORY_BYTES = 4 << 30


def _child(kind: str, args: tuple, conn) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))
    try:
        if kind == "index":
            result = oc.Index(*args)
        else:
            result = oc.json_schema.build_regex_from_schema(*args)
        conn.send(("ok", pickle.dumps(result)))
    except Exception as err:  # reported to the parent, which raises ValueError
        conn.send(("error", str(err)[:300]))


def _run(kind: str, args: tuple, timeout_s: float):
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(kind, args, sender), daemon=True)
    proc.start()
    sender.close()
    try:
        if not receiver.poll(timeout_s):
            raise ValueError(f"outlines-core did not finish compiling within {timeout_s:g} s")
        try:
            status, payload = receiver.recv()
        except EOFError:
            raise ValueError("outlines-core crashed while compiling (out of memory?)") from None
        if status != "ok":
            raise ValueError(f"outlines-core cannot compile this constraint: {payload}")
        return pickle.loads(payload)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        receiver.close()


def build_index(regex: str, vocabulary: oc.Vocabulary, timeout_s: float) -> oc.Index:
    """`oc.Index(regex, vocabulary)` built in a child; ValueError on error/timeout."""
    return _run("index", (regex, vocabulary), timeout_s)


def build_json_regex(schema_json: str, whitespace: str, timeout_s: float) -> str:
    """`build_regex_from_schema(schema_json, whitespace)` in a child; ValueError on
    error/timeout."""
    return _run("json_regex", (schema_json, whitespace), timeout_s)
