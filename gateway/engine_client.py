"""Async client of the EngineCore process: supervises it and routes its outputs.

Owns: the engine process (its restarts), its EngineChannel
(gateway/engine_channel.py: both sockets, typed messages, utility calls), one
asyncio.Queue per in-flight request, the OutputProcessor (detokenization, stop
strings, n > 1 fan-in). A background task reads engine outputs and routes them
to the queues; a watcher on the process sentinel marks the engine dead and
fails every waiting request with EngineDeadError (503). How the engine starts
is pluggable (gateway/engine_launch.py): `launcher` (default: a local spawned
process) and `bind_host` (None: ipc:// sockets; a host: tcp://host:<port>).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator, Callable

from formwork.core.engine_proc import start_engine_process
from formwork.gateway.engine_channel import EngineChannel
from formwork.gateway.engine_launch import Launcher, end_process
from formwork.gateway.errors import APIError, EngineDeadError
from formwork.gateway.output_processor import OutputProcessor, RequestOutput
from formwork.gateway.replay import replaying
from formwork.schemas.config import EngineConfig
from formwork.schemas.engine import (EngineCoreAbort, EngineInfo, EngineShutdown, EngineStats,
                                     InputMessage, UtilityResult)
from formwork.schemas.sampling import SamplingParams

log = logging.getLogger("formwork.gateway")
REPLAY_WAIT_S = 60.0      # how long a request that produced nothing waits for a restart


class EngineRequestError(APIError):
    """The engine finished a request with an error (refused it, grammar failed);
    `param` is the field the engine named (EngineCoreOutput.error_param)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, message, param=param, code="engine_request_error")


class EngineClient:
    """`state`: "starting" until the first handshake, "ready", "restarting" while a
    dead engine is replaced (bounded backoff), "failed" after `max_restarts`
    consecutive failed restarts (then `on_fatal` is called: the server exits
    non-zero so an outside supervisor takes over)."""

    def __init__(self, config: EngineConfig, tokenizer=None, *,
                 ready_timeout_s: float = 900.0, max_restarts: int = 5,
                 restart_backoff_s: float = 1.0, on_fatal=None,
                 launcher: Launcher | None = None, bind_host: str | None = None,
                 name: str = "engine") -> None:
        """`tokenizer` may be given later (set_tokenizer) so that it loads while the
        engine starts; it must be set before the first generate(). `name` is how
        logs call this engine ("engine 1" under data parallelism)."""
        self.config = config
        self.name = name
        self.launcher: Launcher = launcher or start_engine_process
        self.ready_timeout_s = ready_timeout_s
        self.tokenizer = None
        self.processor: OutputProcessor | None = None
        if tokenizer is not None:
            self.set_tokenizer(tokenizer)
        self.info: EngineInfo | None = None
        self.state = "starting"
        self.restarts = 0                      # engines started after the first
        self.max_restarts = max_restarts
        self.restart_backoff_s = restart_backoff_s
        self.on_fatal = on_fatal
        self._failed_restarts = 0
        self._restart_task: asyncio.Task | None = None
        self.dead = False
        self._closing = False
        self._ending: Callable[[], APIError] | None = None     # end_requests()
        self._queues: dict[str, asyncio.Queue] = {}
        self._channel = EngineChannel(bind_host)
        self._proc = None                      # the launcher's process-like handle
        self._reader: asyncio.Task | None = None

    def set_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer)

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> EngineInfo:
        """Spawn the engine, wait for its ready handshake, return its model info."""
        self._channel.bind()
        await self._launch()
        return self.info

    async def _launch(self) -> None:
        """Start an engine process and wait for its handshake; then serve."""
        self._proc = self.launcher(self.config, self._channel.in_addr, self._channel.out_addr)
        self.info = await self._channel.wait_ready(self._proc, self.ready_timeout_s)
        loop = asyncio.get_running_loop()
        loop.add_reader(self._proc.sentinel, self._on_engine_exit)
        self._reader = asyncio.create_task(self._read_outputs(), name="engine-output-reader")
        self.dead = False
        self.state = "ready"

    async def _restart(self) -> None:
        """Replace a dead engine: bounded exponential backoff; requests get 503
        with Retry-After meanwhile. After max_restarts consecutive failures,
        on_fatal()."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
            self._reader = None
        while not self._closing:
            if self._failed_restarts >= self.max_restarts:
                self.state = "failed"
                log.error("%s failed %d restarts in a row; giving up", self.name,
                          self._failed_restarts)
                if self.on_fatal is not None:
                    self.on_fatal()
                return
            delay = min(30.0, self.restart_backoff_s * 2 ** self._failed_restarts)
            log.warning("restarting %s in %.1f s (restart %d)", self.name, delay, self.restarts + 1)
            await asyncio.sleep(delay)
            if self._closing:
                return
            self.restarts += 1
            try:
                await self._launch()
            except Exception as e:  # noqa: BLE001 - counted and retried; fatal after the limit
                self._failed_restarts += 1
                log.error("%s restart failed: %s", self.name, e)
                if self._proc is not None and self._proc.is_alive():
                    self._proc.kill()
                continue
            self._failed_restarts = 0
            log.info("%s restarted (pid %s)", self.name, self._proc.pid)
            return

    def _on_engine_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        if not self.dead and not self._closing:
            log.error("%s process exited (code %s); in-flight requests get 503, "
                      "restarting it", self.name, self._proc.exitcode)
        self._fail_all()
        if not self._closing and (self._restart_task is None or self._restart_task.done()):
            self.state = "restarting"
            self._restart_task = asyncio.create_task(self._restart(), name="engine-restart")

    def _fail_all(self) -> None:
        self.dead = True
        for q in self._queues.values():
            q.put_nowait(EngineDeadError())
        self._channel.fail_calls(EngineDeadError)

    def stop_restarts(self) -> None:
        """The server is draining: an engine that dies from now on stays dead (its
        requests still get 503)."""
        self._closing = True

    def end_requests(self, error: Callable[[], APIError]) -> None:
        """Every request in flight ends with `error()`, and so does every later
        generate() (a graceful shutdown whose drain timeout has passed)."""
        self._ending = error
        for q in self._queues.values():
            q.put_nowait(error())

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the engine to stop, then terminate / kill it if it lingers."""
        self._closing = True
        if self._restart_task is not None and not self._restart_task.done():
            self._restart_task.cancel()
        proc = self._proc
        if proc is not None and proc.is_alive():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._send(EngineShutdown()), 2.0)
            await asyncio.to_thread(end_process, proc, timeout_s)
        self.dead = True
        if self._reader is not None:
            self._reader.cancel()
        self._channel.close()

    # -- I/O -------------------------------------------------------------------
    def _gone(self) -> bool:
        return self.dead or (self._proc is not None and not self._proc.is_alive())

    async def _send(self, msg: InputMessage) -> None:
        """EngineDeadError once the engine is gone (never blocks for good)."""
        await self._channel.send(msg, self._gone)

    async def _read_outputs(self) -> None:
        try:
            while True:
                outs = await self._channel.recv()
                if self._channel.answer(outs):
                    continue
                results, to_abort = self.processor.process_outputs(outs.outputs)
                if to_abort:
                    await self._send(EngineCoreAbort(request_ids=to_abort))
                for ro in results:
                    q = self._queues.get(ro.request_id)
                    if q is not None:
                        q.put_nowait(ro)
        except Exception:    # not CancelledError (a BaseException): shutdown, restart
            log.exception("engine output reader failed")
            self._fail_all()

    # -- public API --------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, *, replay: bool = True
                       ) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs (with deltas) until finished. Leaving early aborts it.

        A request the engine's death ended before it yielded anything (it was
        queued, or in prefill) is sent again to the restarted engine, once, if
        the restart takes at most REPLAY_WAIT_S; with `replay=False` (the DP
        client, which re-routes it instead) it gets EngineDeadError with
        `before_output` set. One that yielded output gets the 503."""
        async def retry(_err: EngineDeadError) -> bool:
            if not replay or not await self._until_ready():
                return False
            log.info("%s: the engine died before it produced anything; sent again", request_id)
            return True

        async with contextlib.aclosing(replaying(lambda: self._generate_once(
                request_id, prompt, prompt_token_ids, params), retry)) as gen:
            async for item in gen:
                yield item

    async def _until_ready(self) -> bool:
        """Wait (at most REPLAY_WAIT_S) for a restarted engine; False if it is not back."""
        deadline = time.monotonic() + REPLAY_WAIT_S
        while self.state != "ready" or self.dead:
            if self.state in ("ready", "failed") or self._closing or self._ending is not None \
                    or time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    async def _generate_once(self, request_id: str, prompt: str | None,
                             prompt_token_ids: list[int], params: SamplingParams
                             ) -> AsyncIterator[RequestOutput]:
        if self._ending is not None:
            raise self._ending()
        if self.dead:
            raise EngineDeadError()
        q: asyncio.Queue = asyncio.Queue()
        engine_reqs = self.processor.add_request(request_id, prompt, prompt_token_ids, params,
                                                 time.monotonic())
        self._queues[request_id] = q
        finished = False
        try:
            for er in engine_reqs:
                await self._send(er)
            while not finished:
                item = await q.get()
                if isinstance(item, EngineDeadError):
                    item.after_send = True
                if isinstance(item, Exception):
                    raise item
                failed = [c for c in item.outputs if c.finish_reason == "error"]
                if failed:
                    finished = item.finished
                    raise EngineRequestError(failed[0].error or "the engine failed this request",
                                             param=failed[0].error_param)
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        ids = self.processor.abort_request(request_id)
        if ids and not self.dead:
            await self._send(EngineCoreAbort(request_ids=ids))

    async def call_utility(self, method: str, timeout_s: float = 5.0) -> UtilityResult:
        """The engine's answer to read-only `method`: the struct UTILITY_RESULTS names
        (schemas/engine.py); RuntimeError when the call failed."""
        if self.dead:
            raise EngineDeadError()
        return await self._channel.call(method, timeout_s, self._gone)

    async def is_healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            await self.call_utility("ping", timeout_s)
            return True
        except (EngineDeadError, asyncio.TimeoutError, RuntimeError):
            return False

    async def get_stats(self, timeout_s: float = 5.0) -> EngineStats:
        return await self.call_utility("get_stats", timeout_s)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def node(self) -> str | None:
        """The Ray node the engine runs on (Ray backend only)."""
        return getattr(self._proc, "node_id", None)
