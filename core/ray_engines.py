"""EngineCore processes as Ray actors (`--distributed-executor-backend ray`).

Owns: the Ray connection of the gateway process, one placement group for the
data-parallel engines, and a process-like handle per engine actor. The engine
inside an actor is the very loop `formwork serve` runs in a local process
(`run_engine_core`), speaking the same ZMQ + msgspec protocol over TCP to the
sockets the gateway bound; only the launch and the death watch differ.

Placement: one bundle per engine, `{"CPU": tensor_parallel_size}` (GPUs on
CUDA), strategy SPREAD, so engines land on distinct nodes while there are
nodes, and each engine's tensor-parallel workers are its own local processes
on the node of its bundle (packed by construction). The bundle of an engine is
fixed by its index, so a restarted engine comes back where it was.

Why Ray and not a home-made cluster manager: placement groups, actor death
detection and node addressing are what Ray is for; the gateway keeps only the
protocol.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import replace

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from formwork.core.engine_proc import run_engine_core
from formwork.schemas.config import EngineConfig

log = logging.getLogger("formwork.ray")



def connect(address: str | None = None) -> None:
    """Join the Ray cluster at `address` (or RAY_ADDRESS, or the one `ray start`
    left on this machine). No cluster is started here: a local Ray started from
    a driver listens on every interface of the machine, which a server must not
    do unasked; `ray start --head` says where it listens."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    # ray.init installs a SIGTERM handler that exits at once; the server's own
    # (a graceful drain, gateway/shutdown.py) is put back
    main = threading.current_thread() is threading.main_thread()
    saved = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except ConnectionError as e:
        raise RuntimeError(
            f"distributed_executor_backend 'ray': no Ray cluster at {address!r} ({e}). Start "
            "one first (`ray start --head`, then `ray start --address <head>:6379` on the "
            "other machines) and set RAY_ADDRESS; README 'Scaling out'") from None
    finally:
        if main and saved is not None:
            signal.signal(signal.SIGTERM, saved)


def gateway_host() -> str:
    """The address engines on other nodes reach this gateway at."""
    return ray.util.get_node_ip_address()


@ray.remote(max_restarts=0)
class EngineActor:
    """One EngineCore. `run` blocks the actor for the engine's life."""

    def where(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    def run(self, config: EngineConfig, input_addr: str, output_addr: str, log_level: int) -> int:
        # parent_pid=None: an actor's parent is Ray's worker pool, not the gateway;
        # the gateway ends it with ray.kill, and Ray ends it with its job.
        run_engine_core(config, input_addr, output_addr, None, log_level)
        return 0


class RayEngineHandle:
    """The `multiprocessing.Process` surface EngineClient uses (is_alive,
    sentinel, pid, exitcode, join, terminate, kill) for an engine actor.

    Nothing here blocks the caller (the gateway's event loop): a watcher thread
    learns where the actor runs (pid, node), then waits for its `run` call to
    end (the engine exited, crashed or was killed) and makes `sentinel`, the
    read end of a pipe, readable."""

    def __init__(self, actor, where_ref, run_ref) -> None:
        self.actor = actor
        self.pid: int | None = None
        self.node_id: str | None = None
        self.node_ip: str | None = None
        self.exitcode: int | None = None
        self._done = threading.Event()
        self._r, self._w = os.pipe()
        self.sentinel = self._r
        threading.Thread(target=self._watch, args=(where_ref, run_ref), name="ray-engine-watch",
                         daemon=True).start()

    def _watch(self, where_ref, run_ref) -> None:
        try:
            where = ray.get(where_ref)
            self.pid, self.node_id, self.node_ip = where["pid"], where["node_id"], where["node_ip"]
            log.info("engine actor pid %d on node %s (%s)", self.pid, self.node_id[:8], self.node_ip)
            self.exitcode = ray.get(run_ref)
        except Exception as e:  # noqa: BLE001 - RayActorError and kin: the engine died
            log.warning("engine actor (pid %s) ended: %s", self.pid, type(e).__name__)
            self.exitcode = 1
        self._done.set()
        os.write(self._w, b"x")

    def wait_placed(self, timeout: float | None = None) -> bool:
        """Until pid and node are known (tests, logs); False on timeout or death."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.pid is None and not self._done.is_set():
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return self.pid is not None

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def terminate(self) -> None:
        ray.kill(self.actor, no_restart=True)

    kill = terminate

    def __del__(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


class RayEngineLauncher:
    """Starts engine `index` of `num_engines` in its bundle; `for_engine(i)` is
    the `launcher(config, input_addr, output_addr)` EngineClient calls (again
    after a death)."""

    def __init__(self, config: EngineConfig, num_engines: int, *, ready_timeout_s: float = 300.0) -> None:
        connect()
        self.config = config
        device = "GPU" if config.device == "cuda" else "CPU"
        bundle = {device: float(config.tensor_parallel_size)}
        self.placement_group = placement_group([dict(bundle) for _ in range(num_engines)],
                                               strategy="SPREAD", name=f"formwork-{os.getpid()}")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=ready_timeout_s)
        if not ready:
            remove_placement_group(self.placement_group)
            raise RuntimeError(f"the Ray cluster has no room for {num_engines} engine(s) of "
                               f"{bundle} each (placement group not ready after "
                               f"{ready_timeout_s:.0f} s); see `ray status`")
        self._bundle = bundle
        self.handles: dict[int, RayEngineHandle] = {}

    def for_engine(self, index: int):
        """The launcher of engine `index` (its bundle)."""
        def launch(config: EngineConfig, input_addr: str, output_addr: str) -> RayEngineHandle:
            return self.launch(config, input_addr, output_addr, index=index)
        return launch

    def free_bundle(self) -> int:
        """The first bundle without a live engine: a restarted engine takes the one
        its dead predecessor left."""
        for i in range(self.placement_group.bundle_count):
            if i not in self.handles or not self.handles[i].is_alive():
                return i
        raise RuntimeError("every bundle of the placement group holds a live engine")

    def launch(self, config: EngineConfig, input_addr: str, output_addr: str, *,
               index: int | None = None) -> RayEngineHandle:
        """`launcher(config, input_addr, output_addr)` for EngineClient: engine in
        bundle `index` (default: the first free one)."""
        index = self.free_bundle() if index is None else index
        strategy = PlacementGroupSchedulingStrategy(self.placement_group,
                                                    placement_group_bundle_index=index)
        actor = EngineActor.options(
            scheduling_strategy=strategy, num_cpus=self._bundle.get("CPU", 0),
            num_gpus=self._bundle.get("GPU", 0)).remote()
        where_ref = actor.where.remote()
        # one engine per actor: the engine itself is never data-parallel
        run_ref = actor.run.remote(replace(config, data_parallel_size=1), input_addr, output_addr,
                                   logging.getLogger().getEffectiveLevel())
        handle = RayEngineHandle(actor, where_ref, run_ref)
        self.handles[index] = handle
        log.info("engine %d: Ray actor in bundle %d", index, index)
        return handle

    def shutdown(self) -> None:
        for h in self.handles.values():
            if h.is_alive():
                h.kill()
        remove_placement_group(self.placement_group)
