"""CPU threads for the forward: how many, chosen by the engine while it runs.

Measured on this project's 2-core box (mixed workload, 48 requests, bf16; README
"Busy box"): libgomp's default spin-waiting gives the best quiet throughput
(373 tok/s; OMP_WAIT_POLICY=PASSIVE 274), but when another process keeps one
core busy, a 2-thread team collapses (30 tok/s: every parallel region waits at
its barrier for the thread that shares a core), while a 1-thread team runs
beside the other process at full speed (214 tok/s, as quiet at 1 thread).
So the engine keeps the spin policy and sizes the team to the cores nobody else
is using: `ThreadGovernor`, consulted by the forward thread before each step,
samples /proc/stat (busy time of the cores this process may run on) and this
process's own CPU time about once a second; what others used is what is left
over.

libgomp's spin count is left at its default (GOMP_SPINCOUNT 300000). A lower
one (30000, once the engine's default) made the second before a resize less bad,
but between two parallel regions the engine thread fills grammar bitmasks, long
enough for a team with a short spin to fall asleep and be woken again:
bench/structured_overhead.py at batch 32, five alternating runs each, gave a
median ratio of 0.976 (0.88-1.01) with the default vs 0.955 (0.93-0.99) with
30000, and with a burner on one core bench/busy_box.py gave 204 vs 202 tok/s.
A GOMP_SPINCOUNT the user sets reaches the engine process unchanged.
"""
from __future__ import annotations

import os
import time

SAMPLE_S = 1.0           # how often the governor looks
OTHERS_THRESHOLD = 0.5   # a core counts as taken when others used more than this much of one


def cpu_quota(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs this process's cgroup may use by its CFS quota (the smallest along its
    path; cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), or None
    when there is no quota or it cannot be read.

    A container started with `--cpus 2` (or a Kubernetes pod with a 2-CPU limit)
    on a 64-core host still sees 64 cores in its affinity mask; an OpenMP team of
    64 spin-waiting threads under a 2-CPU quota is throttled at every barrier.
    (The standard library has no such count: `os.process_cpu_count` is the
    affinity mask.)"""
    try:
        with open(proc_cgroup) as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        entries = []
    best = None
    for _id, controllers, path in entries or [("0", "", "/")]:
        if controllers == "":                                   # v2: the unified hierarchy
            hybrid = os.path.join(root, "unified")              # (v1 beside it: mounted there)
            base, files = (hybrid if os.path.isdir(hybrid) else root), ("cpu.max",)
        elif "cpu" in controllers.split(","):                   # v1: the cpu controller's mount
            base = next((os.path.join(root, d) for d in (controllers, "cpu,cpuacct", "cpu")
                         if os.path.isdir(os.path.join(root, d))), None)
            files = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
            if base is None:
                continue
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):       # the cgroup itself, then its ancestors
            q = _read_quota(os.path.join(base, *parts[:depth]), files)
            if q is not None:
                best = q if best is None else min(best, q)
    return best


def _read_quota(directory: str, files: tuple[str, ...]) -> float | None:
    try:
        if len(files) == 1:
            with open(os.path.join(directory, files[0])) as f:
                quota, period = (f.read().split() + ["100000"])[:2]
        else:
            with open(os.path.join(directory, files[0])) as f:
                quota = f.read().strip()
            with open(os.path.join(directory, files[1])) as f:
                period = f.read().strip()
        if quota in ("max", "-1") or int(period) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _affinity() -> frozenset[int]:
    """The cores this process may run on (its affinity mask)."""
    return frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else frozenset(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """Cores this process may run on: its affinity mask, capped by its cgroup's
    CPU quota (rounded down: a thread more than the quota waits at every barrier)."""
    cores = len(_affinity())
    quota = cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    return max(1, cores)


def quota_limited() -> bool:
    """A CPU quota, not the affinity mask, bounds this process: the cores it runs
    on are shared with whoever else the host runs, so /proc/stat says nothing
    about which of them are free (the governor stays off)."""
    return usable_cpus() < len(_affinity())


def _cpu_busy_seconds(cpus: frozenset[int]) -> float | None:
    """Busy (non-idle, non-iowait) seconds summed over `cpus`, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            lines = f.readlines()
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in fields[:8]]   # user nice system idle iowait irq softirq steal
        busy += sum(values) - values[3] - values[4]
    return busy / hz


class ThreadGovernor:
    """Sizes the forward's OpenMP team to the cores other processes leave free.

    `sample()` (cheap; on the forward thread) returns a new thread count when
    the team should change, else None. `max_threads` is the configured count;
    the team never drops below 1 and only changes after two samples agree.
    """

    def __init__(self, max_threads: int, *, clock=time.monotonic, cpu_busy=None,
                 own_cpu=time.process_time, sample_s: float = SAMPLE_S) -> None:
        self.max_threads = max(1, max_threads)
        self.threads = self.max_threads
        cpus = _affinity()
        self._cpu_busy = cpu_busy or (lambda: _cpu_busy_seconds(cpus))
        self._own, self._clock, self._sample_s = own_cpu, clock, sample_s
        self._last = self._read()
        self._proposal: int | None = None
        self.resizes = 0
        self.others = 0.0          # cores other processes used in the last sample

    def _read(self) -> tuple[float, float | None, float]:
        return self._clock(), self._cpu_busy(), self._own()

    def sample(self) -> int | None:
        now = self._clock()
        if now - self._last[0] < self._sample_s:
            return None
        (t0, busy0, own0), (t1, busy1, own1) = self._last, self._read()
        self._last = (t1, busy1, own1)
        if busy0 is None or busy1 is None or t1 <= t0:
            return None
        wall = t1 - t0
        self.others = max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
        taken = int(self.others + 1.0 - OTHERS_THRESHOLD)     # cores counted as taken
        want = max(1, min(self.max_threads, self.max_threads - taken))
        if want == self.threads:
            self._proposal = None
            return None
        if self._proposal != want:          # wait for a second sample to agree
            self._proposal = want
            return None
        self._proposal = None
        self.threads = want
        self.resizes += 1
        return want
