"""The server's check of a request's output constraint, in a child process.

`validate_params` (grammar/selection.py) builds grammars with llguidance (Rust)
and, where llguidance refuses, xgrammar (C++): native code that a schema can
crash. It did: llguidance 1.9 took SIGSEGV building an int64 range of the lowest
few hundred values, and since the check ran on a gateway thread, one request took
the whole server down. Here the check runs in a worker process instead
(concurrent.futures over a spawn context, two workers: the box has two cores). A
worker that dies fails its pool and every check in it, so each of those is tried
once more alone, in a process of its own: the checks beside the culprit pass, and
the culprit, crashing again, is refused with a 400 and remembered; it never
reaches the engine. A check running past TIMEOUT_S is abandoned (its pool's
workers killed) and refused, not remembered.

Verdicts are cached by the constraint's canonical text (a schema sent again is
not checked again), as the engine caches compiled grammars. The pool starts with
the server (`start`) so that the first constrained request does not wait for it.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import ctypes
import logging
import multiprocessing
import sys
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

from formwork.gpu.child_process import die_with_parent, main_module_not_reimported
from formwork.schemas.structured import StructuredOutputsParams

log = logging.getLogger("formwork.gateway")

WORKERS = 2
CACHE_SIZE = 4096          # verdicts kept (canonical constraint text -> message or None)
TIMEOUT_S = 60.0           # a check still running then is abandoned (its workers killed)
CRASHED = ("the grammar compiler crashed on this constraint (the process checking it died); "
           "it is refused")


def constraint_verdict(params: StructuredOutputsParams, default_backend: str) -> str | None:
    """In the worker: None if some backend serves `params`, else the refusal's text."""
    from formwork.grammar.selection import validate_params   # the worker's first call imports
    try:
        validate_params(params, default_backend)
    except ValueError as e:
        return str(e)
    except Exception as e:      # noqa: BLE001 - a check that failed in itself
        # Its exception may not pickle back to the server (jsonschema's ref errors
        # hold closures: the request got a 500 about pickling); the constraint
        # cannot be shown servable, so it is refused with what went wrong.
        log.exception("checking a constraint failed: %.200s", params.cache_key())
        return (f"this constraint could not be checked ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''}); it is refused")
    return None


PROCESS_NAME = b"fw-constraints"    # the workers' name in ps / top (comm), beside "python"


def _init_worker() -> None:
    """Dies with the server, and is named so that it is told from the engine process."""
    die_with_parent()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, PROCESS_NAME, 0, 0, 0)  # PR_SET_NAME


def _ready() -> bool:
    """In a new worker: import what every check needs (llguidance's converter)."""
    from formwork.grammar import llguidance_grammar, selection  # noqa: F401
    return True


class ConstraintChecker:
    """`await check(params, backend)`: None, or the message of a refusal (a bad
    schema, regex or grammar, or one that crashed the checking process)."""

    def __init__(self,
                 check: Callable[[StructuredOutputsParams, str], str | None] = constraint_verdict,
                 *, workers: int = WORKERS, cache_size: int = CACHE_SIZE,
                 timeout_s: float = TIMEOUT_S) -> None:
        """`check` must be a module-level function (the worker imports it by name)."""
        self._check = check
        self._timeout_s = timeout_s
        self._workers = workers
        self._cache: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self._cache_size = cache_size
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.crashes = 0

    def start(self) -> None:
        """Start a worker now (it imports the grammar libraries, ~1 s); the others
        start when checks overlap."""
        with main_module_not_reimported():
            future = self._executor().submit(_ready)
        future.result()

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = self._new_pool(self._workers)
        return self._pool

    @staticmethod
    def _new_pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
        return concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker)

    def _discard(self, pool: concurrent.futures.ProcessPoolExecutor, kill: bool = False) -> None:
        if self._pool is pool:
            self._pool = None
        if kill:            # a hung check: its worker would never take another
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    async def check(self, params: StructuredOutputsParams, default_backend: str) -> str | None:
        key = f"{default_backend}\n{params.cache_key()}"
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        pool = self._executor()
        try:
            verdict = await self._run(pool, params, default_backend)
        except BrokenProcessPool:
            # some check crashed the pool's process: this one, or another beside it. Tried
            # again alone, in a process of its own: only the culprit crashes that.
            self._discard(pool)
            alone = self._new_pool(1)
            try:
                verdict = await self._run(alone, params, default_backend)
            except BrokenProcessPool:
                self.crashes += 1
                log.error("a constraint crashed the grammar check; refused: %.200s",
                          params.cache_key())
                verdict = CRASHED
            except asyncio.TimeoutError:
                return self._timed_out(alone, params)
            finally:
                alone.shutdown(wait=False, cancel_futures=True)
        except asyncio.TimeoutError:
            return self._timed_out(pool, params)
        self._cache[key] = verdict
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return verdict

    async def _run(self, pool: concurrent.futures.ProcessPoolExecutor,
                   params: StructuredOutputsParams, default_backend: str) -> str | None:
        with main_module_not_reimported():     # a worker may be spawned by this submit
            future = pool.submit(self._check, params, default_backend)
        return await asyncio.wait_for(asyncio.wrap_future(future), self._timeout_s)

    def _timed_out(self, pool: concurrent.futures.ProcessPoolExecutor,
                   params: StructuredOutputsParams) -> str:
        """A check still running: its pool's workers are killed (a hung one would never
        take another check); the refusal is not kept (a busy box may have slowed it)."""
        self._discard(pool, kill=True)
        log.error("checking a constraint took over %.0f s; refused: %.200s",
                  self._timeout_s, params.cache_key())
        return f"checking this constraint took more than {self._timeout_s:.0f} s; it is refused"

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
