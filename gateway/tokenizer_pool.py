"""Chat templating and tokenization off the event loop.

A 2 MB message takes about a second to tokenize; on the event loop's thread that
second stalls every stream and /health. HF fast tokenizers must not be used by
several threads at once on one instance (the Rust side raises "Already
borrowed"), so each worker thread of the pool gets its own copy, made up front
(copy.deepcopy on the caller's thread, before serving: a copy reads the
original, which the event loop keeps using for decode and vocab lookups).
The Rust encoder releases the GIL (transformers encodes through
`encode_batch`), so the event loop runs while a worker tokenizes; the
chat template (jinja, Python) shares the GIL at the interpreter's switch
interval.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import copy
import functools
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")

DEFAULT_TOKENIZER_THREADS = 2


class TokenizerPool:
    """`await pool.run(fn, *args)` calls `fn(tokenizer, *args)` on a worker thread
    with that thread's own tokenizer copy. Owns the copies and the threads."""

    def __init__(self, tokenizer, num_threads: int = DEFAULT_TOKENIZER_THREADS) -> None:
        assert num_threads >= 1, num_threads
        self._spare = [copy.deepcopy(tokenizer) for _ in range(num_threads)]
        self._lock = threading.Lock()
        self._local = threading.local()
        self._pool = cf.ThreadPoolExecutor(max_workers=num_threads,
                                           thread_name_prefix="formwork-tokenize")

    def _own(self):
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:           # first call on this worker: take one of the copies
            with self._lock:
                tok = self._local.tokenizer = self._spare.pop()
        return tok

    def _call(self, fn: Callable[..., T], args: tuple, kwargs: dict[str, Any]) -> T:
        return fn(self._own(), *args, **kwargs)

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(self._call, fn, args, kwargs))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
