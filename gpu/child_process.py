"""What every process formwork spawns needs (the EngineCore in core/engine_proc.py,
tensor-parallel workers in gpu/tp_worker.py): die with the parent, and a spawn
that does not re-run the parent's main script. Here, below both, so that one
copy serves them (gpu may not import core)."""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when the thread that spawned it
    exits (Linux PR_SET_PDEATHSIG; a no-op elsewhere). A parent that died before
    this call (a spawned child imports for a second or more first) sends nothing:
    then this process exits at once (one such constraint-checking worker was found
    alive an hour after the server that started it)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        parent = multiprocessing.parent_process()
        if parent is not None and os.getppid() != parent.pid:
            os._exit(1)


@contextlib.contextmanager
def main_module_not_reimported() -> Iterator[None]:
    """A spawned child re-runs the parent's main script unless it is guarded by
    `if __name__ == "__main__":` -- a script calling `LLM()` at top level would
    start engines recursively. The children's entry points live in formwork's
    modules and need nothing from __main__, so for the moment of the spawn the
    main module looks like an interactive session's (no __file__, no __spec__),
    for which multiprocessing imports nothing. Restored right after."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)
