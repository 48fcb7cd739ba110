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
        cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else frozenset(range(os.cpu_count() or 1))
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
