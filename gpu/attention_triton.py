"""Triton attention backend: KV store by slot mapping, then unified paged
attention over the whole flat batch (prefill chunks and decodes) in one launch.

Runs on CUDA; on CPU only under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch

from formwork.gpu.attention import AttentionBackend, AttentionMetadata, flatten_batch
from formwork.kernels.kv_store import store_kv
from formwork.kernels.paged_attention import paged_attention


class TritonAttentionBackend(AttentionBackend):
    """Two launches per layer over the common metadata's flat tensors
    (slot_mapping, block_table, query_start_loc, seq_lens): graph-capturable."""

    name = "triton"

    def build_metadata(self, query_lens: list[int], seq_lens: list[int],
                       block_tables: list[list[int]], block_size: int,
                       device: torch.device | str) -> AttentionMetadata:
        """The common fields only: the kernels need no host-built work split."""
        return AttentionMetadata.from_flat(flatten_batch(query_lens, seq_lens, block_tables, block_size),
                                           device)

    @property
    def graph_capturable(self) -> bool:
        return True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> out [T, H, D]; writes k_cache/v_cache."""
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta.block_table, meta.query_start_loc,
                               meta.seq_lens, scale)
