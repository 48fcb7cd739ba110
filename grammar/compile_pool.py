"""The thread pool grammar compiles run in, at a lower CPU priority than the
engine: a storm of new schemas then takes the CPU the forward leaves over
instead of halving decode for every running request (#13 point 6). Compiles
wait for their grammar anyway."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

COMPILE_NICE_INCREMENT = 10     # nice value of compile threads above the engine's


def lower_thread_priority() -> None:
    """Lower the calling thread's CPU priority (Linux: nice is per thread)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid,
                       min(19, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICE_INCREMENT))
    except (OSError, AttributeError):   # another OS, or not permitted: same priority
        pass


def compile_pool(num_threads: int) -> ThreadPoolExecutor:
    """`num_threads` compile threads, each at the lowered priority."""
    return ThreadPoolExecutor(num_threads, thread_name_prefix="grammar-compile",
                              initializer=lower_thread_priority)
