"""The gateway's end of the protocol to one EngineCore process (asyncio, ZMQ +
msgspec; the messages are schemas/engine.py's).

Owns: the ZMQ context and both sockets (ipc:// in a private folder, or
tcp://bind_host:<random>), the msgpack encoder and typed decoder, and the
utility calls waiting for their answers. Knows nothing of requests or
restarts: EngineClient (gateway/engine_client.py) owns those, reads every
output through `recv` and hands utility answers to `answer`. Survives engine
restarts (a new engine connects to the same endpoints).
"""
from __future__ import annotations

import asyncio
import itertools
import shutil
import time
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from formwork.core.engine_proc import READY_CALL_ID, handshake_result, utility_value
from formwork.core.ipc import make_ipc_dir
from formwork.gateway.engine_launch import bind_pair
from formwork.gateway.errors import EngineDeadError
from formwork.schemas.engine import (EngineCoreOutputs, EngineCoreUtility, EngineInfo,
                                     InputMessage, UtilityResult, encode_input)

SEND_RETRY_S = 0.005


class EngineChannel:
    def __init__(self, bind_host: str | None) -> None:
        """`bind_host`: None for ipc:// sockets in a private folder; a host for
        tcp://host:<random port> (an engine on another node)."""
        self.bind_host = bind_host
        self.in_addr = self.out_addr = ""
        self._tmpdir = make_ipc_dir() if bind_host is None else None
        self._ctx = zmq.asyncio.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._out = self._ctx.socket(zmq.PULL)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(READY_CALL_ID + 1)

    def bind(self) -> tuple[str, str]:
        """Bind both sockets; (input_addr, output_addr) for the engine to connect to."""
        self.in_addr, self.out_addr = bind_pair(self._in, self._out, self._tmpdir, self.bind_host)
        return self.in_addr, self.out_addr

    def close(self) -> None:
        """Close both sockets without waiting on a peer; remove the ipc folder."""
        self._ctx.destroy(linger=0)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    async def wait_ready(self, proc, timeout_s: float) -> EngineInfo:
        """The handshake of the engine `proc` (process-like: is_alive, exitcode);
        RuntimeError when it exits, says it could not start, or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self._out.poll(500):
                info = handshake_result(await self.recv())
                if info is not None:
                    return info
            if not proc.is_alive():
                raise RuntimeError(f"engine process exited during start-up "
                                   f"(exit code {proc.exitcode})")
        raise RuntimeError(f"engine not ready after {timeout_s:.0f} s")

    async def send(self, msg: InputMessage, gone: Callable[[], bool]) -> None:
        """Never blocks for good: a PUSH socket without a live peer would wait forever
        (e.g. the engine got the same SIGTERM as this process), so send without
        blocking and give up with EngineDeadError once `gone()` says the engine is."""
        data = encode_input(self._encoder, msg)
        while True:
            try:
                await self._in.send(data, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if gone():
                    raise EngineDeadError() from None
                await asyncio.sleep(SEND_RETRY_S)

    async def recv(self) -> EngineCoreOutputs:
        return self._decoder.decode(await self._out.recv())

    # -- utility calls ------------------------------------------------------------
    async def call(self, method: str, timeout_s: float, gone: Callable[[], bool]) -> UtilityResult:
        """Call the engine's read-only `method`; its answer, checked to be the struct
        UTILITY_RESULTS names (RuntimeError otherwise, or when the call failed).
        The answer arrives through `answer` (the caller's output reader)."""
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            await self.send(EngineCoreUtility(call_id=call_id, method=method), gone)
            result = await asyncio.wait_for(fut, timeout_s)
        finally:
            self._calls.pop(call_id, None)
        return utility_value(method, result)

    def answer(self, outs: EngineCoreOutputs) -> bool:
        """True when `outs` is a utility answer (given to its call if still awaited)."""
        if outs.utility_call_id is None:
            return False
        fut = self._calls.pop(outs.utility_call_id, None)
        if fut is not None and not fut.done():
            fut.set_result(outs.utility_result)
        return True

    def fail_calls(self, error: Callable[[], Exception]) -> None:
        """Every awaited call ends with `error()` (the engine died)."""
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(error())
        self._calls.clear()
