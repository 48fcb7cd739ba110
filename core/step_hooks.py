"""What tests and debugging observe of EngineCore's step, passed in as an
argument (never attributes set on the engine). Default: no hooks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(slots=True)
class StepHooks:
    """Called on the engine thread, inside step().

    trace: called with each phase's name as it starts: "schedule", "execute",
        "grammar", "wait", "aborts", "update" (the step order).
    check_invariants: run the scheduler's (and KV manager's) check_invariants()
        after every step, failed ones included.
    on_timing: called after each forward with that step's timestamps
        (perf_counter): "fill_start", "fill_end" (the grammar bitmask) and the
        executor's own ("submitted", "forward_end", ...).
    """

    trace: Callable[[str], None] | None = None
    check_invariants: bool = False
    on_timing: Callable[[dict[str, float]], None] | None = None
