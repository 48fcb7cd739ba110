"""Folders for the ZMQ ipc sockets between the gateway and its EngineCore."""
from __future__ import annotations

import os
import shutil
import tempfile


IPC_PREFIX = "formwork-ipc-"


def make_ipc_dir() -> str:
    """A fresh folder for the two ZMQ ipc sockets, named after this process
    (`formwork-ipc-<pid>-*`); folders left by processes that no longer run
    (a SIGKILLed server) are removed first."""
    remove_stale_ipc_dirs()
    return tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")


def remove_stale_ipc_dirs(root: str | None = None) -> list[str]:
    """Remove this user's `formwork-ipc-<pid>-*` folders whose process is gone."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(IPC_PREFIX):
            continue
        pid = name[len(IPC_PREFIX):].split("-", 1)[0]
        path = os.path.join(root, name)
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
