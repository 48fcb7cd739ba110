"""The EngineCore process: a busy loop between two ZMQ sockets.

    gateway --PUSH--> input  (msgpack InputMessage, tagged: add | abort | utility | shutdown)
    gateway <--PULL-- output (msgpack EngineCoreOutputs)

The gateway binds both sockets; this process connects. The first message on
the output socket is the ready handshake: EngineCoreOutputs with
`utility_call_id == READY_CALL_ID` and `utility_result` an EngineInfo (or a
UtilityError when the engine could not start). Utility calls are answered
with the struct UTILITY_RESULTS names for their method, or a UtilityError.

Loop: block on input while idle; otherwise drain input without blocking, step,
publish outputs. The process exits on a shutdown message, SIGTERM, or when its
parent dies (PR_SET_PDEATHSIG on Linux, plus a getppid() check).
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import threading
import time
import weakref

import msgspec
import zmq

from formwork.gpu.child_process import die_with_parent, main_module_not_reimported
from formwork.schemas.config import EngineConfig
from formwork.schemas.errors import param_of
from formwork.schemas.engine import (UTILITY_RESULTS, EngineCoreAbort, EngineCoreOutput,
                                     EngineCoreOutputs, EngineCoreRequest, EngineCoreUtility,
                                     EngineInfo, EngineShutdown, FinishReason, InputMessage, Pong,
                                     Reset, UtilityError, UtilityResult)

log = logging.getLogger("formwork.engine")

READY_CALL_ID = 0
IDLE_POLL_MS = 1000          # how often an idle engine checks that its parent lives
PARENT_CHECK_S = 1.0


def handshake_result(outs: EngineCoreOutputs) -> EngineInfo | None:
    """The engine info when `outs` is the ready handshake; None for any other
    message (a late output of an engine that died: nobody waits for it);
    RuntimeError when the engine says it could not start."""
    if outs.utility_call_id != READY_CALL_ID:
        return None
    result = outs.utility_result
    if isinstance(result, UtilityError):
        raise RuntimeError(f"engine failed to start: {result.message}")
    if not isinstance(result, EngineInfo):
        raise RuntimeError(f"engine handshake carried {type(result).__name__}, not EngineInfo")
    return result


def utility_value(method: str, result: UtilityResult | None) -> UtilityResult:
    """The answer to utility call `method`, checked to be the struct UTILITY_RESULTS
    names; RuntimeError when the engine answered with an error (or anything else)."""
    if isinstance(result, UtilityError):
        raise RuntimeError(f"engine utility {method!r} failed: {result.message}")
    expected = UTILITY_RESULTS.get(method)
    if expected is None or not isinstance(result, expected):
        raise RuntimeError(f"engine utility {method!r} answered {type(result).__name__}")
    return result


def cuda_graphs_text(sizes) -> str:
    """How start-up logs say whether decode steps replay CUDA graphs."""
    return f"on (decode batch sizes {min(sizes)}-{max(sizes)})" if sizes else "off"


def engine_info(core) -> EngineInfo:
    """What the handshake and `info` carry: the core's start-up facts and this process's."""
    info = core.info
    return EngineInfo(max_model_len=core.max_model_len, vocab_size=core.vocab_size,
                      num_kv_blocks=info.num_kv_blocks, block_size=core.config.block_size,
                      device=info.device, dtype=info.dtype,
                      attention_backend=info.attention_backend,
                      cuda_graph_sizes=tuple(info.cuda_graph_sizes),
                      structured_backend=core.config.structured_backend,
                      load_seconds=round(info.load_seconds, 2), pid=os.getpid(),
                      omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", ""),
                      gomp_spincount=os.environ.get("GOMP_SPINCOUNT", ""))


class EngineLoop:
    """Owns the sockets; the EngineCore owns all request state."""

    def __init__(self, core, in_sock: zmq.Socket, out_sock: zmq.Socket, parent_pid: int | None) -> None:
        """parent_pid: the gateway's pid, checked once a second (the engine exits when
        it is gone); None for an engine whose parent is not the gateway (a Ray actor)."""
        self.core = core
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.parent_pid = parent_pid
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(InputMessage)
        self.poller = zmq.Poller()
        self.poller.register(in_sock, zmq.POLLIN)
        self.running = True
        self._last_parent_check = time.monotonic()

    def run(self) -> None:
        while self.running:
            if not self.core.has_unfinished_requests():
                if not self.poller.poll(IDLE_POLL_MS):
                    self._check_parent()
                    continue
            self._drain_input()
            self._check_parent()
            if self.running and self.core.has_unfinished_requests():
                outs = self.core.step()
                if outs.outputs:
                    self._send(outs)

    def _check_parent(self) -> None:
        now = time.monotonic()
        if now - self._last_parent_check < PARENT_CHECK_S:
            return
        self._last_parent_check = now
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.warning("parent process %d is gone; engine exits", self.parent_pid)
            self.running = False

    def _drain_input(self) -> None:
        while self.running:
            try:
                frame = self.in_sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = self.decoder.decode(frame.buffer)
            except msgspec.DecodeError as e:
                self._unreadable(frame.buffer, e)
                continue
            self._handle(msg)

    def _unreadable(self, buf, err: msgspec.DecodeError) -> None:
        """A message the decoder refuses (the gateway checks requests before sending
        them: schemas/engine.encode_input; a client of another version could still
        send one): the engine carries on, and a request it can name is finished
        with an error rather than left waiting."""
        log.error("unreadable input message dropped: %s", err)
        try:
            raw = msgspec.msgpack.decode(buf)
        except msgspec.DecodeError:
            return
        if isinstance(raw, dict) and raw.get("type") == "add" \
                and isinstance(raw.get("request_id"), str):
            self._fail(raw["request_id"], f"the engine could not read this request: {err}")

    def _fail(self, request_id: str, error: str, param: str | None = None) -> None:
        """Finish a request the engine did not take, with `error` (OpenAI's param)."""
        self._send(EngineCoreOutputs(outputs=[EngineCoreOutput(
            request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR,
            error=error, error_param=param)]))

    def _handle(self, msg: InputMessage) -> None:
        match msg:
            case EngineShutdown():
                self.running = False
            case EngineCoreRequest():
                try:
                    self.core.add_request(msg)
                except ValueError as e:  # refused: finish it alone, the engine carries on
                    self._fail(msg.request_id, str(e), param_of(e))
            case EngineCoreAbort():
                # applied at once (between steps), so a later message sees them done
                self.core.abort_requests(msg.request_ids)
                outs = self.core.apply_aborts()
                if outs.outputs:
                    self._send(outs)
            case EngineCoreUtility():
                self._send(EngineCoreOutputs(utility_call_id=msg.call_id,
                                             utility_result=self._utility(msg.method)))

    def _utility(self, method: str) -> UtilityResult:
        """The struct UTILITY_RESULTS names for `method`, or a UtilityError."""
        try:
            if method == "ping":
                return Pong()
            if method == "get_stats":
                return self.core.get_stats()
            if method == "info":
                return engine_info(self.core)
            if method == "reset_prefix_cache":
                return Reset(done=self.core.reset_prefix_cache())
            return UtilityError(message=f"unknown utility method {method!r}; "
                                        f"known: {tuple(UTILITY_RESULTS)}")
        except Exception as e:  # a failing utility call must not kill the engine
            log.exception("utility %s failed", method)
            return UtilityError(message=f"{type(e).__name__}: {e}")

    def _send(self, outs: EngineCoreOutputs) -> None:
        self.out_sock.send(self.encoder.encode(outs), copy=False)


def start_engine_process(config: EngineConfig, input_addr: str,
                         output_addr: str) -> multiprocessing.process.BaseProcess:
    """Spawn the EngineCore process.

    Not daemonic: a daemonic process may not start children, and the outlines
    backend compiles in a child process (bounded in time and memory). The child
    still dies with its parent (PR_SET_PDEATHSIG, parent checks), and an atexit
    hook ends it so the interpreter's exit never waits on a live engine.
    """
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=run_engine_core, name="EngineCore", daemon=False,
                       args=(config, input_addr, output_addr, os.getpid(),
                             logging.getLogger().getEffectiveLevel()))
    with main_module_not_reimported():
        proc.start()
    atexit.register(_stop_at_exit, weakref.ref(proc))
    return proc


def _stop_at_exit(ref: "weakref.ref[multiprocessing.process.BaseProcess]") -> None:
    proc = ref()
    if proc is not None and proc.is_alive():
        proc.terminate()
        proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)


def _on_sigterm(signum, frame) -> None:
    raise SystemExit(0)


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str,
                    parent_pid: int | None, log_level: int = logging.INFO) -> None:
    """Process entry point (multiprocessing spawn target; core/ray_engines.py runs it
    inside a Ray actor with parent_pid None)."""
    die_with_parent()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # the parent owns Ctrl-C and tells us
        signal.signal(signal.SIGTERM, _on_sigterm)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    in_sock = ctx.socket(zmq.PULL)
    in_sock.connect(input_addr)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 2000)
    out_sock.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    core = None
    try:
        # here, in the engine process: the gateway that imports this module stays torch-free
        from formwork.core.engine_core import EngineCore
        core = EngineCore(config)
        out_sock.send(encoder.encode(EngineCoreOutputs(
            utility_call_id=READY_CALL_ID, utility_result=engine_info(core))))
        EngineLoop(core, in_sock, out_sock, parent_pid).run()
    except SystemExit:
        pass
    except BaseException as e:
        log.exception("engine failed")
        if core is None:
            out_sock.send(encoder.encode(EngineCoreOutputs(
                utility_call_id=READY_CALL_ID,
                utility_result=UtilityError(message=f"{type(e).__name__}: {e}"))))
        raise
    finally:
        if core is not None:
            core.shutdown()
        in_sock.close(linger=0)
        out_sock.close()
        ctx.term()
