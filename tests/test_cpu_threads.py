"""ThreadGovernor: the forward's team sized to the cores other processes leave
free, from /proc/stat and this process's CPU time (fed here by fake clocks)."""
from __future__ import annotations

import os

import pytest

from formwork.gpu.cpu_threads import ThreadGovernor, _cpu_busy_seconds


class Box:
    """A fake machine: each tick of 1 s, this process uses `own` cores and
    other processes `others` cores."""

    def __init__(self):
        self.t = self.busy = self.own_cpu = 0.0

    def tick(self, own: float, others: float) -> None:
        self.t += 1.0
        self.own_cpu += own
        self.busy += own + others


def governor(box: Box, threads: int = 2) -> ThreadGovernor:
    return ThreadGovernor(threads, clock=lambda: box.t, cpu_busy=lambda: box.busy,
                          own_cpu=lambda: box.own_cpu)


def run(g: ThreadGovernor, box: Box, own: float, others: float, ticks: int) -> list[int | None]:
    out = []
    for _ in range(ticks):
        box.tick(own, others)
        out.append(g.sample())
    return out


def test_quiet_box_keeps_every_thread():
    box = Box()
    g = governor(box)
    assert run(g, box, own=2.0, others=0.1, ticks=5) == [None] * 5 and g.threads == 2


def test_a_busy_core_shrinks_the_team_after_two_samples_and_it_grows_back():
    box = Box()
    g = governor(box)
    # a spinning 2-thread team beside a process burning one core: 1.33 vs 0.67
    assert run(g, box, own=1.33, others=0.67, ticks=3) == [None, 1, None]
    assert g.threads == 1 and g.resizes == 1 and g.others == pytest.approx(0.67)
    assert run(g, box, own=1.0, others=1.0, ticks=3) == [None] * 3      # stays at 1
    assert run(g, box, own=1.0, others=0.05, ticks=2) == [None, 2]      # the core is free again
    assert g.threads == 2 and g.resizes == 2


def test_one_noisy_sample_changes_nothing_and_never_below_one():
    box = Box()
    g = governor(box, threads=4)
    assert run(g, box, own=2.0, others=2.0, ticks=1) == [None]
    assert run(g, box, own=4.0, others=0.0, ticks=3) == [None] * 3 and g.threads == 4
    assert run(g, box, own=0.5, others=3.5, ticks=2) == [None, 1]
    assert g.threads == 1


def test_samples_are_rate_limited_and_proc_stat_is_read():
    box = Box()
    g = governor(box)
    box.t += 0.5
    assert g.sample() is None and g._last[0] == 0.0          # too soon: nothing read
    busy = _cpu_busy_seconds(frozenset(os.sched_getaffinity(0)))
    assert busy is not None and busy > 0


_TEAM_PROBE = r"""
import os, sys, threading, torch
torch.set_num_threads(2)
torch.ones(1 << 20).sum()                    # the main thread's team exists, as the forward's would
from formwork.grammar.backend import allocate_bitmask

def tasks():
    return len(os.listdir("/proc/self/task"))

def on_side_thread(fn):
    # counted inside the side thread: libgomp keeps a master thread's team alive
    # until that thread exits
    seen = []
    t = threading.Thread(target=lambda: (seen.append(tasks()), fn(), seen.append(tasks())))
    t.start(); t.join()
    return seen[1] - seen[0]
which = sys.argv[1]
fn = (lambda: allocate_bitmask(256, 49152)) if which == "bitmask" else \
     (lambda: torch.full((256, 1536), -1, dtype=torch.int32))
print(on_side_thread(fn))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="an OpenMP team needs 2 cores")
def test_grammar_bitmask_opens_no_openmp_team_off_the_forward_thread():
    """The engine thread allocates grammar bitmasks while the forward runs; a torch
    op that opens an OpenMP parallel region there leaves libgomp threads behind and
    measured 2x slower decoding for the rest of the process. The control (torch.full
    of the same size) shows the probe sees such a team."""
    import subprocess
    import sys

    def new_threads(which: str) -> int:
        out = subprocess.run([sys.executable, "-c", _TEAM_PROBE, which], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "2"})
        assert out.returncode == 0, out.stderr[-2000:]
        return int(out.stdout.strip().splitlines()[-1])
    assert new_threads("torch.full") >= 1
    assert new_threads("bitmask") == 0


def _cgroup_tree(tmp_path, cgroup_lines: str, files: dict[str, str]):
    (tmp_path / "proc_cgroup").write_text(cgroup_lines)
    for rel, text in files.items():
        (tmp_path / "fs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / rel).write_text(text)
    return str(tmp_path / "fs"), str(tmp_path / "proc_cgroup")


@pytest.mark.parametrize("lines,files,want", [
    # cgroup v2, a container root with `--cpus 2`
    ("0::/\n", {"cpu.max": "200000 100000\n", "cgroup.controllers": "cpu\n"}, 2.0),
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),
    # v2 nested: the tightest of the cgroup and its ancestors
    ("0::/pod/ctr\n", {"cpu.max": "max 100000\n", "pod/cpu.max": "150000 100000\n",
                       "pod/ctr/cpu.max": "400000 100000\n"}, 1.5),
    # v1 (and hybrid: the v2 entry has no cpu.max there)
    ("2:cpu,cpuacct:/docker/abc\n0::/\n",
     {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
      "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n", "unified/cgroup.controllers": ""}, 3.0),
    ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ("", {}, None),                                       # nothing readable: no quota
])
def test_cpu_quota_reads_cgroup_v1_and_v2(tmp_path, lines, files, want):
    from formwork.gpu.cpu_threads import cpu_quota
    root, proc = _cgroup_tree(tmp_path, lines, files)
    assert cpu_quota(root, proc) == want


def test_forward_threads_follow_a_cpu_quota_below_the_cores(monkeypatch):
    """A 2-CPU container on a many-core host: the engine's team is 2 threads,
    not one per core of the affinity mask; without a quota torch's default stays;
    a set count wins; tensor-parallel ranks share the usable cores."""
    import torch

    from formwork.gpu import cpu_threads, rank_setup
    from formwork.schemas.config import EngineConfig
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda _pid: set(range(64)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 32)
    monkeypatch.setattr(cpu_threads, "cpu_quota", lambda: 2.5)
    assert cpu_threads.usable_cpus() == 2 and cpu_threads.quota_limited()
    assert rank_setup.forward_threads(EngineConfig()) == 2
    assert rank_setup.forward_threads(EngineConfig(num_threads=5)) == 5
    assert rank_setup.forward_threads(EngineConfig(tensor_parallel_size=2)) == 1
    monkeypatch.setattr(cpu_threads, "cpu_quota", lambda: None)
    assert cpu_threads.usable_cpus() == 64 and not cpu_threads.quota_limited()
    assert rank_setup.forward_threads(EngineConfig()) is None
    assert rank_setup.forward_threads(EngineConfig(tensor_parallel_size=2)) == 32
    monkeypatch.setattr(cpu_threads, "cpu_quota", lambda: 0.3)
    assert rank_setup.forward_threads(EngineConfig()) == 1
