"""Which attention backend a device gets: the one "auto" rule.

Its own module so that the backends (gpu/attention_torch.py,
gpu/attention_triton.py) import only their common base, gpu/attention.py.
"""
from __future__ import annotations

import torch

from formwork.gpu.attention import AttentionBackend
from formwork.gpu.attention_torch import TorchAttentionBackend
from formwork.schemas.config import ATTENTION_BACKENDS


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """"auto" -> "triton" on CUDA, "torch" elsewhere; other names are checked and kept."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r}: expected 'auto', 'torch' or 'triton'")
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return name


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """A backend instance for `name` ("auto", "torch" or "triton") on `device`."""
    device = torch.device(device)
    name = resolve_backend_name(name, device)
    if name == "torch":
        return TorchAttentionBackend(paged_decode=None if device.type == "cpu" else False)
    # imported here: Triton loads its compiler stack, which the CPU path never needs
    from formwork.gpu.attention_triton import TritonAttentionBackend
    return TritonAttentionBackend()
