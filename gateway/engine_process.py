"""The offline `LLM`'s EngineCore in its own process, driven synchronously.

As vLLM V1 does by default: the engine runs in a fresh spawned process (the
same `run_engine_core` loop and ZMQ + msgspec protocol `formwork serve` uses),
so a caller's own torch/OpenMP work cannot slow the engine's threads (with
libgomp, once a second thread of a process has run an OpenMP region, both lose
their spin-wait), and the engine's OpenMP team is its own, whatever the caller's
process imported or ran first.

`EngineProcess` has the surface `LLM` uses from an in-process `EngineCore`:
add_request / abort_requests / step / has_unfinished_requests / check_prompt /
get_stats / reset_prefix_cache / shutdown, plus `tokenizer`, `max_model_len`,
`vocab_size`, `info`.
`LLM(data_parallel_size=N)` drives N of them (gateway/dp_offline.py).
"""
from __future__ import annotations

import itertools
import shutil
import time
import weakref

import msgspec
import zmq

from formwork.core.engine_proc import READY_CALL_ID, handshake_result, utility_value
from formwork.core.ipc import make_ipc_dir
from formwork.core.prompt_check import check_prompt
from formwork.gateway.engine_launch import Launcher, bind_pair, end_process, start_engine_process
from formwork.gpu.model_files import load_model_tokenizer
from formwork.schemas.config import EngineConfig
from formwork.schemas.engine import (EngineCoreAbort, EngineCoreOutputs, EngineCoreRequest,
                                     EngineCoreUtility, EngineInfo, EngineShutdown, EngineStats,
                                     InputMessage, encode_input)

POLL_MS = 200
_SHUTDOWN = msgspec.msgpack.encode(EngineShutdown())


def _release(ctx: zmq.Context, in_sock: zmq.Socket, proc, tmpdir: str, timeout_s: float) -> None:
    """Ask the engine to stop, end its process, close the sockets, remove the IPC
    directory. A module function run by `weakref.finalize` (at `shutdown()`, when the
    EngineProcess is collected, or at interpreter exit, whichever comes first) so
    that it holds no reference to the EngineProcess: a `__del__` that ran only in
    the interpreter's final garbage collection (an `LLM` inside a reference cycle)
    blocked for ever in `Context.term`."""
    if proc.is_alive():
        try:
            in_sock.send(_SHUTDOWN, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        end_process(proc, timeout_s)
    ctx.destroy(linger=0)
    shutil.rmtree(tmpdir, ignore_errors=True)


class EngineDiedError(RuntimeError):
    """The engine process exited; the requests it held are lost."""


class EngineProcess:
    def __init__(self, config: EngineConfig, *, ready_timeout_s: float = 900.0,
                 launcher: Launcher | None = None, bind_host: str | None = None,
                 tokenizer=None, wait: bool = True) -> None:
        """`tokenizer`: given (shared by several engines) or loaded here while the
        engine loads the model. `wait=False` returns once the process is
        started; then `wait_ready()` must be called before anything else (several
        engines load at once). `launcher`/`bind_host`: as EngineClient's (a Ray
        actor over TCP, gateway/engine_factory.py)."""
        self.config = config
        self._tmpdir = make_ipc_dir()
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._out = self._ctx.socket(zmq.PULL)
        for sock in (self._in, self._out):   # closing never waits for undelivered messages
            sock.setsockopt(zmq.LINGER, 0)
        in_addr, out_addr = bind_pair(self._in, self._out, self._tmpdir, bind_host)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._pending: set[str] = set()          # engine request ids not finished yet
        self._buffered: list[EngineCoreOutputs] = []
        self._call_ids = itertools.count(READY_CALL_ID + 1)
        self._closed = False
        self.ready_timeout_s = ready_timeout_s
        self.tokenizer = tokenizer
        self._proc = (launcher or start_engine_process)(config, in_addr, out_addr)
        self._finalizer = weakref.finalize(self, _release, self._ctx, self._in, self._proc,
                                           self._tmpdir, 2.0)
        if wait:
            self.wait_ready()

    # -- lifecycle --------------------------------------------------------------
    def wait_ready(self) -> None:
        """Load the tokenizer unless given (while the engine loads the model), then
        wait for the engine's handshake; shut down and re-raise on failure."""
        try:
            if self.tokenizer is None:
                self.tokenizer = load_model_tokenizer(
                    self.config.model, weights=self.config.reads_weights)
            info = self._wait_ready(self.ready_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.info: EngineInfo = info
        self.max_model_len: int = info.max_model_len
        self.vocab_size: int = info.vocab_size

    def _wait_ready(self, timeout_s: float) -> EngineInfo:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._out.poll(POLL_MS):
                info = handshake_result(self._decoder.decode(self._out.recv()))
                if info is not None:
                    return info
            if not self._proc.is_alive():
                raise RuntimeError(f"engine process exited during start-up "
                                   f"(exit code {self._proc.exitcode})")
        raise RuntimeError(f"engine not ready after {timeout_s:.0f} s")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        if self._finalizer.detach() is not None:
            _release(self._ctx, self._in, self._proc, self._tmpdir, timeout_s)

    # -- I/O ---------------------------------------------------------------------
    def _send(self, msg: InputMessage) -> None:
        data = encode_input(self._encoder, msg)
        while True:
            try:
                self._in.send(data, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                self._check_alive()
                time.sleep(0.005)

    def _check_alive(self) -> None:
        if self._closed or not self._proc.is_alive():
            lost = len(self._pending)
            self._pending.clear()
            raise EngineDiedError(f"engine process exited (code {self._proc.exitcode}); "
                                  f"{lost} unfinished requests lost")

    @property
    def output_socket(self) -> zmq.Socket:
        """For a caller polling several engines at once (read only by step())."""
        return self._out

    def has_buffered_output(self) -> bool:
        return bool(self._buffered)

    def check_alive(self) -> None:
        """EngineDiedError when the engine process is gone."""
        self._check_alive()

    def _recv(self) -> EngineCoreOutputs:
        while not self._out.poll(POLL_MS):
            self._check_alive()
        return self._decoder.decode(self._out.recv())

    # -- the EngineCore surface LLM uses ----------------------------------------------
    def check_prompt(self, ids: list[int]) -> None:
        check_prompt(ids, self.max_model_len, self.vocab_size)

    def add_request(self, req: EngineCoreRequest) -> None:
        self._send(req)
        self._pending.add(req.request_id)

    def abort_requests(self, request_ids) -> None:
        ids = [r for r in request_ids if r in self._pending]
        if ids:
            self._send(EngineCoreAbort(request_ids=ids))
            self._pending.difference_update(ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending)

    def step(self) -> EngineCoreOutputs:
        """The next batch of outputs the engine published (it steps on its own)."""
        if not self._pending:
            return EngineCoreOutputs(outputs=[])
        outs = self._buffered.pop(0) if self._buffered else self._recv()
        while outs.utility_call_id is not None:          # a late utility answer
            outs = self._recv()
        for o in outs.outputs:
            if o.finish_reason is not None:
                self._pending.discard(o.request_id)
        return outs

    def get_stats(self) -> EngineStats:
        return self._call("get_stats")

    def reset_prefix_cache(self) -> bool:
        return self._call("reset_prefix_cache").done

    def _call(self, method: str):
        """A utility call, answered in order with the outputs (kept for step())."""
        call_id = next(self._call_ids)
        self._send(EngineCoreUtility(call_id=call_id, method=method))
        while True:
            outs = self._recv()
            if outs.utility_call_id == call_id:
                return utility_value(method, outs.utility_result)
            if outs.utility_call_id is None:
                self._buffered.append(outs)
