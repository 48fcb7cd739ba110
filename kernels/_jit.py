"""Triton kernels that are compiled for CUDA or interpreted on CPU, chosen at launch.

`triton.jit` decides between compiling and interpreting when it decorates a
function (it reads TRITON_INTERPRET then). Kernels here are wrapped lazily so
that the decision is taken at the first launch instead: a process that sets
TRITON_INTERPRET=1 any time before launching (the CPU tests do) gets the
interpreter, whatever imported this package first; a GPU process gets compiled
kernels. Kernels wrapped this way must not call other jitted helpers.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import triton


def interpreting() -> bool:
    """True when Triton launches run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class LazyKernel:
    """`kernel[grid](*args)` like a jitted function; jits `fn` once per mode."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._by_mode: dict[bool, Any] = {}

    def __getitem__(self, grid: Any) -> Any:
        mode = interpreting()
        kernel = self._by_mode.get(mode)
        if kernel is None:
            kernel = self._by_mode[mode] = triton.jit(self.fn)
        return kernel[grid]


def lazy_jit(fn: Callable[..., Any]) -> LazyKernel:
    return LazyKernel(fn)


def check_launch_device(*tensors: torch.Tensor) -> None:
    """All tensors on one device; CPU tensors only under the interpreter."""
    device = tensors[0].device
    for t in tensors:
        assert t.device == device, f"tensors on {t.device} and {device}"
    if device.type == "cpu" and not interpreting():
        raise RuntimeError(
            "Triton kernels run on CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 "
            "(interpreter, for tests) or call the torch implementation instead"
        )
