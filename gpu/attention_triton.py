"""Triton attention backend: KV store by slot mapping, then unified paged
attention over the whole flat batch (prefill chunks and decodes) in one launch.

Runs on CUDA; on CPU only under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch

from formwork.gpu.attention import AttentionBackend, AttentionMetadata
from formwork.kernels.kv_store import store_kv
from formwork.kernels.paged_attention import paged_attention


class TritonAttentionBackend(AttentionBackend):
    """Two launches per layer; reads only `meta`'s flat tensors (slot_mapping,
    block_table, query_start_loc, seq_lens), never its torch-path groups."""

    name = "triton"
    needs_groups = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> out [T, H, D]; writes k_cache/v_cache."""
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta.block_table, meta.query_start_loc,
                               meta.seq_lens, scale)
