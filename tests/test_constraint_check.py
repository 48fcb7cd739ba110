"""The server's constraint check runs in worker processes (gateway/constraint_check.py):
a schema that crashes the native grammar code takes a worker down, never the server.
The crash is injected: a check function that kills its own process for one marker."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from formwork.gateway.constraint_check import CRASHED, ConstraintChecker, constraint_verdict
from formwork.schemas.structured import StructuredOutputsParams as P


def crash_on_marker(params: P, backend: str) -> str | None:
    """In the worker: SIGSEGV itself for a schema titled "crash", sleep for "slow";
    otherwise the real check."""
    title = params.json.get("title") if isinstance(params.json, dict) else None
    if title == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if title == "slow":
        time.sleep(30)
    return constraint_verdict(params, backend)


class Odd(Exception):
    """An exception that does not pickle (it holds a closure), as jsonschema's ref errors."""


def odd_on_marker(params: P, backend: str) -> str | None:
    """In the worker: the real check, except that for a schema titled "odd" the
    backends' check raises an exception that is no ValueError and does not pickle."""
    import formwork.grammar.selection as selection
    title = params.json.get("title") if isinstance(params.json, dict) else None
    real = selection.validate_params
    if title == "odd":
        def odd(*_):
            raise Odd(lambda: None)
        selection.validate_params = odd
    try:
        return constraint_verdict(params, backend)
    finally:
        selection.validate_params = real


def test_a_check_that_fails_in_itself_is_a_refusal_not_a_server_error():
    """A check raising something other than ValueError sent that exception back to the
    server, where one holding a closure failed to unpickle: a 500 about pickling."""
    checker = ConstraintChecker(odd_on_marker, workers=1)

    async def run():
        verdict = await checker.check(P(json={"title": "odd", "type": "integer"}), "auto")
        assert verdict.startswith("this constraint could not be checked (Odd") and "refused" in verdict
        assert await checker.check(P(json={"type": "integer"}), "auto") is None
    try:
        asyncio.run(run())
    finally:
        checker.shutdown()


def test_a_crashing_constraint_is_refused_and_the_others_are_checked():
    checker = ConstraintChecker(crash_on_marker, workers=2)

    async def run():
        good = P(json={"type": "object", "properties": {"a": {"type": "integer"}}})
        bad = P(json={"type": "string", "pattern": "[a-"})
        crash = P(json={"title": "crash", "type": "integer"})
        # checked beside the crash: the pool breaks under them, they are tried again
        verdicts = await asyncio.gather(checker.check(good, "auto"), checker.check(crash, "auto"),
                                        checker.check(bad, "auto"))
        assert verdicts[0] is None
        assert verdicts[1] == CRASHED and checker.crashes == 1
        assert "pattern" in verdicts[2]
        # remembered: not sent to a worker again; and the checker still works
        assert await checker.check(crash, "auto") == CRASHED and checker.crashes == 1
        assert await checker.check(P(regex="[0-9]+"), "auto") is None
        assert "regex" in await checker.check(P(regex="(ab"), "auto")
    try:
        asyncio.run(run())
    finally:
        checker.shutdown()


def test_a_hung_check_is_abandoned_and_not_remembered():
    checker = ConstraintChecker(crash_on_marker, workers=1, timeout_s=2)

    async def run():
        slow = P(json={"title": "slow", "type": "integer"})
        t0 = time.monotonic()
        verdict = await checker.check(slow, "auto")
        assert "took more than 2 s" in verdict and time.monotonic() - t0 < 20
        assert await checker.check(P(json={"type": "boolean"}), "auto") is None   # a new worker
        assert len(checker._cache) == 1                # the timeout is not kept
    try:
        asyncio.run(run())
    finally:
        checker.shutdown()


def test_the_verdicts_equal_the_in_process_check():
    from formwork.gateway.params import validate_constraint
    from formwork.gateway.errors import APIError
    checker = ConstraintChecker()
    cases = [P(json={"type": "integer", "minimum": 10, "maximum": 2}),
             P(json={"type": "string", "format": "date-time"}), P(choice=["a", "b"]),
             P(grammar="root ::= missing"), P(json={"type": "integer", "minimum": 2 ** 64})]

    async def run():
        return [await checker.check(p, "auto") for p in cases]
    try:
        got = asyncio.run(run())
    finally:
        checker.shutdown()
    for p, verdict in zip(cases, got):
        try:
            validate_constraint(p, "response_format")
            want = None
        except APIError as e:
            want = e.message.removeprefix("response_format: ")
        assert verdict == want, p
