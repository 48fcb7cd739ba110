"""Spawned children (engine, tensor-parallel workers, constraint checkers) die
with their parent, also when the parent died while the child was still starting
(PR_SET_PDEATHSIG set after the parent's death never fires)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

CHILD = r'''
import multiprocessing as mp, os, sys, time

def child(path, wait):
    time.sleep(wait)                     # still importing when the parent dies
    from formwork.gpu.child_process import die_with_parent
    die_with_parent()
    open(path, "w").write("alive")
    time.sleep(30)

if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=child, args=(sys.argv[1], float(sys.argv[2])))
    p.start()
    print(p.pid, flush=True)
    if sys.argv[3] == "die":
        os._exit(0)
    time.sleep(3)                        # the child is up; then the parent is gone
    os._exit(0)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("parent", ["die", "live"])
def test_a_child_whose_parent_died_while_it_started_exits(tmp_path, parent):
    script, marker = tmp_path / "spawn_child.py", tmp_path / "alive"
    script.write_text(CHILD)
    out = subprocess.run([sys.executable, str(script), str(marker), "1.0", parent],
                         capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    try:
        if parent == "die":
            deadline = time.time() + 15
            while time.time() < deadline and os.path.exists(f"/proc/{pid}") \
                    and "zombie" not in _state(pid):
                time.sleep(0.2)
            assert not marker.exists()           # it exited before doing anything
            assert not os.path.exists(f"/proc/{pid}") or "zombie" in _state(pid)
        else:                                    # a live parent: the child ran, and
            assert marker.exists()               # died with it when it exited
            deadline = time.time() + 10
            while time.time() < deadline and os.path.exists(f"/proc/{pid}") \
                    and "zombie" not in _state(pid):
                time.sleep(0.2)
            assert not os.path.exists(f"/proc/{pid}") or "zombie" in _state(pid)
    finally:
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, 9)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((ln for ln in f if ln.startswith("State:")), "").lower()
    except OSError:
        return "gone zombie"
