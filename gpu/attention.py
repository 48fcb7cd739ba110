"""Paged attention: the KV cache layout, the metadata every backend reads and
the backend interface. The backends: gpu/attention_torch.py (CPU, reference),
gpu/attention_triton.py (CUDA); gpu/attention_select.py picks one.

KV cache per layer: `k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
head_dim]`; token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

A step's batch is FLAT: the new tokens of many sequences, each sequence
contiguous and in order. A backend's `build_metadata` runs once per step on
the host: `flatten_batch` lays the batch out in numpy, `AttentionMetadata.from_flat`
makes the common device tensors, and a backend that needs more (the torch
backend's work split) adds it in a subclass of `AttentionMetadata`.
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Self

import numpy as np
import torch


@dataclass(slots=True)
class FlatBatch:
    """One step's batch on the host, int64 numpy: n sequences, T tokens."""
    query_lens: np.ndarray       # [n] new tokens per sequence
    seq_lens: np.ndarray         # [n] context incl. new tokens
    query_start_loc: np.ndarray  # [n + 1]
    block_table: np.ndarray      # [n, max_blocks] (padding and negative ids: 0)
    seq_of_token: np.ndarray     # [T] sequence of each flat row
    positions: np.ndarray        # [T]
    slot_mapping: np.ndarray     # [T] -1 = do not store


def flatten_batch(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                  block_size: int) -> FlatBatch:
    """Sequence i has `query_lens[i]` new tokens at positions
    `seq_lens[i]-query_lens[i] .. seq_lens[i]-1`; `block_tables[i]` must cover
    `seq_lens[i]` positions. A negative block id gives slot -1 (its positions
    are not stored, and must not be attended). Does not mutate its arguments."""
    n = len(query_lens)
    assert n == len(seq_lens) == len(block_tables) and n > 0
    q = np.asarray(query_lens, dtype=np.int64)
    s = np.asarray(seq_lens, dtype=np.int64)
    assert (q >= 1).all() and (q <= s).all(), "need 1 <= query_len <= seq_len"
    qsl = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q, out=qsl[1:])
    num_blocks = -(-s // block_size)
    width = max(max(len(row) for row in block_tables), 1)
    table = np.zeros((n, width), dtype=np.int64)
    for i, row in enumerate(block_tables):
        assert len(row) >= num_blocks[i], f"block table {i} covers < {s[i]} positions"
        table[i, :len(row)] = row
    seq_of_token = np.repeat(np.arange(n), q)
    pos = np.arange(qsl[-1]) - qsl[seq_of_token] + (s - q)[seq_of_token]
    block = table[seq_of_token, pos // block_size]
    slots = np.where(block >= 0, block * block_size + pos % block_size, -1)
    return FlatBatch(q, s, qsl, np.maximum(table, 0), seq_of_token, pos, slots)


def to_device(a: np.ndarray, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(torch.device(device), dtype)


@dataclass(slots=True)
class AttentionMetadata:
    """What every backend reads; a backend needing more subclasses it."""
    query_start_loc: torch.Tensor     # [num_seqs + 1] int32
    seq_lens: torch.Tensor            # [num_seqs] int32, context incl. new tokens
    block_table: torch.Tensor         # [num_seqs, max_blocks] int32 (padding: 0)
    slot_mapping: torch.Tensor        # [T] int64, -1 = do not store
    store_index: torch.Tensor | None  # [T'] int64 rows with slot >= 0; None = all rows
    max_query_len: int
    max_seq_len: int

    @classmethod
    def from_flat(cls, flat: FlatBatch, device: torch.device | str, **extra) -> Self:
        """The common fields of `flat` on `device`; `extra`: a subclass's own fields."""
        valid = flat.slot_mapping >= 0
        return cls(
            query_start_loc=to_device(flat.query_start_loc, device, torch.int32),
            seq_lens=to_device(flat.seq_lens, device, torch.int32),
            block_table=to_device(flat.block_table, device, torch.int32),
            slot_mapping=to_device(flat.slot_mapping, device),
            store_index=None if valid.all() else to_device(np.nonzero(valid)[0], device),
            max_query_len=int(flat.query_lens.max()), max_seq_len=int(flat.seq_lens.max()),
            **extra)


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device | str
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (k_cache, v_cache) per layer, each [num_blocks, block_size, kvh, d].

    On CPU each cache is an anonymous memory map: the kernel hands out zero pages
    and commits one only when it is first written, so an idle engine with a 2 GB
    cache holds the pages its requests have used, not 2 GB (`torch.zeros` writes
    every page up front: an idle `formwork serve` engine held 3.0 GB, now 0.96).
    The first write of each page costs a fault instead of the up-front memset:
    the mixed offline workload's first pass (64 requests, fresh engine, every page
    new) ran at 1,066 vs 1,063 tok/s, seven and eight runs alternating."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if torch.device(device).type == "cpu":
        return [(_zero_pages(shape, dtype), _zero_pages(shape, dtype)) for _ in range(num_layers)]
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]


def _zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on fresh anonymous pages (page-aligned; the tensor keeps
    the map alive). Private, as malloc's memory: mmap's default, MAP_SHARED, is
    shmem-backed and shared across a fork. Transparent huge pages are not asked
    for: with them (madvise mode, 2-core box) the same first pass ran at 941-1,085
    tok/s and a second pass over committed pages no faster (1,325-1,412 vs
    1,403-1,426 with the up-front memset, 1,328-1,441 on 4 KB pages) -- the
    attention's reads gain nothing measurable, and a 2 MB fault may stall on
    compaction."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int,
                             head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block id costs across all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


class AttentionBackend:
    """Builds its own per-step metadata; stores new K/V by `meta.slot_mapping`,
    then attends causally over each sequence's paged context."""

    name = "base"

    def build_metadata(self, query_lens: list[int], seq_lens: list[int],
                       block_tables: list[list[int]], block_size: int,
                       device: torch.device | str) -> AttentionMetadata:
        """The metadata `forward` reads for one step (arguments as `flatten_batch`)."""
        raise NotImplementedError

    @property
    def graph_capturable(self) -> bool:
        """True when `forward` reads only the metadata's fixed-shape device tensors
        (query_start_loc, seq_lens, block_table, slot_mapping, where slot -1 rows are
        skipped) and launches the same work for the same shapes: then a decode step
        can be captured in a CUDA graph and replayed over static copies of those
        tensors (gpu/cuda_graph.py)."""
        return False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> out [T, H, D]. Does not mutate q/k/v;
        writes k_cache/v_cache."""
        raise NotImplementedError


def copy_kv_to_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """The torch backend's K/V store: rows of k/v [T, KVH, D] into their slots by
    index_copy_, slot -1 rows skipped (`meta.store_index`, found once per step).
    The Triton backend's is kernels/kv_store.store_kv (by slot mapping alone)."""
    kvh, d = k.shape[1], k.shape[2]
    slots, rows = meta.slot_mapping, meta.store_index
    if rows is not None:
        slots, k, v = slots[rows], k[rows], v[rows]
    k_cache.view(-1, kvh, d).index_copy_(0, slots, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slots, v)
