"""CUDA graphs for pure-decode steps.

A decode step (every scheduled request has exactly one new token) of n rows
replays the graph captured for the smallest capture size b >= n. The n real
rows are copied into static buffers; rows n..b-1 are padding: token 0 at
position 0, slot -1 (their K/V are never stored), a context of one key in
block 0 (read, never written). The first n rows of the graph's static output
are returned. Every other step runs eagerly (ModelRunner decides).

Capture goes through a `GraphFactory`: `CudaGraphFactory` on CUDA. Tests pass
a fake whose replay re-runs the captured callable over the static buffers;
that checks the copy-in / padding / bucketing plumbing on CPU, not that the
forward is capturable.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from formwork.gpu.attention import AttentionBackend, AttentionMetadata

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """[1, 2, 4, 8, 16, 24, ...] up to cap = min(max_num_seqs, limit), plus cap
    itself, so that every batch the scheduler can form has a graph."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
    cap = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4) if s <= cap] + list(range(8, cap + 1, 8))
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def padded_size(n: int, sizes: Sequence[int]) -> int | None:
    """Smallest of the ascending `sizes` >= n; None when n exceeds them all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphFactory(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        """Records `fn` (reads and writes only tensors that outlive it) and returns
        the graph and fn's output tensor, which every `replay()` refills."""
        ...


class CudaGraphFactory:
    """torch.cuda.graph capture; all graphs share one memory pool (made lazily)."""

    def __init__(self) -> None:
        self._pool = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        return graph, out


def pick_graph_factory(device_type: str, backend: AttentionBackend, enforce_eager: bool,
                       override: GraphFactory | None = None) -> GraphFactory | None:
    """The factory to capture decode graphs with, or None for eager only.

    Graphs need a `graph_capturable` backend (not the torch backend: its work
    split is host-built per step) and CUDA; `override` (tests) stands in for CUDA."""
    if enforce_eager or not backend.graph_capturable:
        return None
    if override is not None:
        return override
    return CudaGraphFactory() if device_type == "cuda" else None


def _pad_rows(n: int, width: int) -> tuple[list[int], list[int], list[list[int]]]:
    """`build_metadata`'s (query_lens, seq_lens, block_tables) for n pad rows: one
    token at position 0, block id -1 (slot -1: never stored; attends to one key
    of block 0, read, never written)."""
    return [1] * n, [1] * n, [[-1] * width] * n


class DecodeGraphRunner:
    """Owns the static decode inputs and one graph per capture size.

    Static buffers (max_bs = largest size): input ids and positions [max_bs]
    int64, and the metadata the model's backend builds for max_bs pad rows
    (block tables max_blocks_per_seq wide); each step's metadata, from the same
    `build_metadata`, is copied into its first rows. Writes K/V only through
    the model's forward, at real rows' slots.
    """

    def __init__(self, model, kv_caches, *, sizes: Sequence[int], block_size: int,
                 max_blocks_per_seq: int, device: torch.device | str, factory: GraphFactory):
        self.sizes = sorted(set(sizes))
        if not self.sizes or self.sizes[0] < 1:
            raise ValueError(f"sizes: need positive capture sizes, got {list(sizes)}")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self._factory = factory
        self._backend = model.attn_backend
        assert self._backend.graph_capturable, self._backend.name
        max_bs = self.sizes[-1]
        with torch.inference_mode():
            self._i64 = torch.zeros((2, max_bs), dtype=torch.int64, device=device)  # ids, positions
            self._static = self._backend.build_metadata(
                *_pad_rows(max_bs, max_blocks_per_seq), block_size, device)
        self._graphs: dict[int, tuple[Graph, torch.Tensor]] = {}
        self.replays: collections.Counter[int] = collections.Counter()  # capture size -> replays

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def fits(self, query_lens: Sequence[int], seq_lens: Sequence[int]) -> bool:
        """A captured pure-decode batch whose contexts fit the static block table."""
        return (bool(self._graphs) and 0 < len(query_lens) <= self.max_size
                and all(q == 1 for q in query_lens)
                and max(seq_lens) <= self.max_blocks_per_seq * self.block_size)

    def _meta(self, b: int) -> AttentionMetadata:
        """The static metadata's first b rows (views). A graph-capturable backend
        reads only these tensors; the rest describes the pad rows of capture
        (max_seq_len: the upper bound)."""
        s = self._static
        return dataclasses.replace(
            s, query_start_loc=s.query_start_loc[:b + 1], seq_lens=s.seq_lens[:b],
            block_table=s.block_table[:b], slot_mapping=s.slot_mapping[:b],
            max_seq_len=self.max_blocks_per_seq * self.block_size)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest size first (smaller graphs reuse the shared pool); each size
        runs once eagerly before capture (lazy init, Triton compile, cuBLAS).
        Pad-only inputs (slot -1): neither run writes the KV cache."""
        for b in reversed(self.sizes):
            meta = self._meta(b)
            ids, positions = self._i64[0, :b], self._i64[1, :b]

            def fn(ids=ids, positions=positions, meta=meta) -> torch.Tensor:
                return self.model(ids, positions, self.kv_caches, meta)

            try:
                fn()
                self._graphs[b] = self._factory.capture(fn)
            except Exception as e:
                raise RuntimeError(f"CUDA-graph capture of the decode step failed at batch size {b}: {e}; "
                                   "set enforce_eager=True (--enforce-eager) to run without graphs") from e

    @torch.inference_mode()
    def run(self, input_ids: Sequence[int], seq_lens: Sequence[int],
            block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """Decode row i: token input_ids[i] at position seq_lens[i] - 1 of a context
        covered by block_tables[i] (negative block id -> slot -1). Returns hidden
        [n, hidden], a view of the graph's static output valid until the next run."""
        n = len(input_ids)
        assert self.fits([1] * n, seq_lens), (n, max(seq_lens, default=0))
        b = padded_size(n, self.sizes)
        bs = self.block_size
        _, pad_lens, pad_tables = _pad_rows(b - n, 1)
        tables = [row[:-(-s // bs)] for s, row in zip(seq_lens, block_tables)]
        step = self._backend.build_metadata([1] * b, list(seq_lens) + pad_lens,
                                            tables + pad_tables, bs, "cpu")   # host; copied below
        packed = np.zeros((2, b), dtype=np.int64)                     # ids, positions (pads: 0, 0)
        packed[0, :n] = input_ids
        packed[1, :n] = np.asarray(seq_lens) - 1
        self._i64[:, :b].copy_(torch.from_numpy(packed))
        s = self._static                  # query_start_loc: 0..b already
        s.slot_mapping[:b].copy_(step.slot_mapping)
        s.seq_lens[:b].copy_(step.seq_lens)
        s.block_table[:b, :step.block_table.shape[1]].copy_(step.block_table)
        graph, out = self._graphs[b]
        graph.replay()
        self.replays[b] += 1
        return out[:n]
