"""Paged attention: per-step metadata, the KV cache layout and backends.

KV cache per layer: `k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
head_dim]`; token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

A step's batch is FLAT: the new tokens of many sequences, each sequence
contiguous and in order. `AttentionMetadata.build` runs once per step on the
host and precomputes everything the backends index with.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# Decode rows of very different context lengths go into separate padded
# groups once padding would exceed this fraction of the real work.
_DECODE_PAD_SLACK = 0.5
# With the paged decode kernel, sequences with at most this many new tokens
# (decodes, jump-forward chunks) are attended token by token in the kernel;
# longer chunks (prefills) keep one SDPA call each.
_PAGED_MAX_QUERY = 8


@dataclass(slots=True)
class AttnGroup:
    """Sequences the torch backend attends in one SDPA call.

    Decode group (`token_index` set): P sequences with one new token each.
    Prefill group: one sequence, new tokens `token_start:token_end`.
    """
    token_index: torch.Tensor | None   # [P] int64 flat token rows (decode)
    token_start: int                    # prefill: first flat row
    token_end: int                      # prefill: one past the last flat row
    block_index: torch.Tensor | None   # [P, nb] int64 blocks to gather; None -> no cached prefix
    mask: torch.Tensor | None          # bool [P, 1, q, nb*block_size], True = attend


@dataclass(slots=True)
class DecodeRows:
    """Token rows for the paged decode kernel: each attends to the first
    seq_lens[i] keys of its sequence (decodes, and each token of a short chunk)."""
    token_index: torch.Tensor | None   # [Pd] int64 flat rows; None = every row, in order
    block_table: torch.Tensor          # [Pd, max_blocks] int32 (negative ids clamped to 0)
    seq_lens: torch.Tensor             # [Pd] int32: keys row i attends to (its position + 1)


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    seq_lens: torch.Tensor          # [num_seqs] int32, context incl. new tokens
    block_table: torch.Tensor       # [num_seqs, max_blocks] int32 (padding: 0)
    slot_mapping: torch.Tensor      # [T] int64, -1 = do not store
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    store_index: torch.Tensor | None  # [T'] int64 rows with slot >= 0; None = all rows
    groups: list[AttnGroup]           # torch backend work split ([] if built with_groups=False)
    decode: DecodeRows | None = None  # with paged_decode=True: decodes here, not in groups

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str, *,
              with_groups: bool = True, paged_decode: bool = False) -> "AttentionMetadata":
        """Sequence i has `query_lens[i]` new tokens at positions
        `seq_lens[i]-query_lens[i] .. seq_lens[i]-1`; `block_tables[i]` must
        cover `seq_lens[i]` positions. A negative block id gives slot -1 (its
        positions are not stored, and must not be attended). `with_groups=False`
        skips the torch backend's work split (`groups` stays empty) for backends
        whose `needs_groups` is False; `paged_decode=True` puts the decode rows in
        `decode` (for a paged decode kernel) instead of padded groups."""
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
        valid = slots >= 0
        table = np.maximum(table, 0)

        dev = torch.device(device)
        as_t = lambda a, dt=torch.int64: torch.from_numpy(np.ascontiguousarray(a)).to(dev, dt)  # noqa: E731
        decode, short = None, np.zeros(n, dtype=bool)
        if paged_decode and with_groups:
            # Decodes and short chunks (jump-forward tokens): one kernel row per
            # token, causal by giving token at position p a context of p + 1 keys
            # (its K/V are stored before attention runs).
            short = q <= _PAGED_MAX_QUERY
            if short.all() and (q == 1).all():
                decode = DecodeRows(None, as_t(table, torch.int32), as_t(s, torch.int32))
            elif short.any():
                rows = np.nonzero(short[seq_of_token])[0]
                seq = seq_of_token[rows]
                decode = DecodeRows(as_t(rows), as_t(table[seq], torch.int32),
                                    as_t(pos[rows] + 1, torch.int32))
        return cls(
            query_start_loc=as_t(qsl, torch.int32), seq_lens=as_t(s, torch.int32),
            block_table=as_t(table, torch.int32), slot_mapping=as_t(slots),
            max_query_len=int(q.max()), max_seq_len=int(s.max()),
            query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens), block_size=block_size,
            store_index=None if valid.all() else as_t(np.nonzero(valid)[0]),
            groups=(_build_groups(q, s, qsl, table, block_size, as_t, skip=short)
                    if with_groups else []),
            decode=decode,
        )


def _build_groups(q, s, qsl, table, block_size, as_t, skip=None) -> list[AttnGroup]:
    """Decode rows -> padded groups of similar context length; prefills -> one
    each. Sequences where `skip` is True are left out (the paged kernel has them)."""
    groups: list[AttnGroup] = []
    nblocks = -(-s // block_size)
    keep = np.ones(len(q), dtype=bool) if skip is None else ~skip
    decodes = np.nonzero((q == 1) & keep)[0]
    decodes = decodes[np.argsort(s[decodes], kind="stable")]
    start = 0
    for end in range(1, len(decodes) + 1):
        if end < len(decodes):
            members = nblocks[decodes[start:end + 1]]
            padded = len(members) * members[-1]
            if padded <= (1 + _DECODE_PAD_SLACK) * members.sum() + 2 or end - start < 4:
                continue
        idx = decodes[start:end]
        nb = int(nblocks[idx].max())
        keys = np.arange(nb * block_size)
        mask = keys[None, :] < s[idx][:, None]                       # [P, L]
        groups.append(AttnGroup(
            token_index=as_t(qsl[idx]), token_start=0, token_end=0,
            block_index=as_t(table[idx, :nb]),
            mask=as_t(mask[:, None, None, :], torch.bool)))
        start = end
    for i in np.nonzero((q > 1) & keep)[0]:
        a, b, ctx = int(qsl[i]), int(qsl[i + 1]), int(s[i])
        if q[i] == ctx:  # no cached prefix: causal attention over the new tokens only
            groups.append(AttnGroup(None, a, b, None, None))
            continue
        nb = int(nblocks[i])
        keys = np.arange(nb * block_size)
        rows = np.arange(ctx - q[i], ctx)                              # query positions
        mask = keys[None, :] <= rows[:, None]                         # [q, L]
        groups.append(AttnGroup(None, a, b, as_t(table[i:i + 1, :nb]),
                                as_t(mask[None, None], torch.bool)))
    return groups


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device | str
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (k_cache, v_cache) per layer, each [num_blocks, block_size, kvh, d]."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int,
                             head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block id costs across all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


class AttentionBackend:
    """Stores new K/V by `meta.slot_mapping`, then attends causally over each
    sequence's paged context. Does not mutate q/k/v; writes k_cache/v_cache."""

    name = "base"
    needs_groups = True   # reads `meta.groups` (AttentionMetadata.build(with_groups=...))
    paged_decode = False  # reads decode rows from `meta.decode` (build(paged_decode=...))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> out [T, H, D]."""
        raise NotImplementedError


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Write rows of k/v [T, KVH, D] into their slots; slot -1 rows are skipped."""
    kvh, d = k.shape[1], k.shape[2]
    slots, rows = meta.slot_mapping, meta.store_index
    if rows is not None:
        slots, k, v = slots[rows], k[rows], v[rows]
    k_cache.view(-1, kvh, d).index_copy_(0, slots, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slots, v)


class TorchAttentionBackend(AttentionBackend):
    """Reference/CPU path: prefill sequences one SDPA call each; decode rows
    either in one call of the CPU paged decode kernel (kernels/cpu_decode_attention,
    when it builds here) or batched into padded gather + SDPA calls."""

    name = "torch"

    def __init__(self, paged_decode: bool | None = None):
        """paged_decode: None -> use the CPU decode kernel if it can be built."""
        if paged_decode is None:
            from formwork.kernels import cpu_decode_attention
            paged_decode = cpu_decode_attention.available()
        self.paged_decode = paged_decode
        # Gathered K/V land in two reused buffers instead of fresh tensors: a
        # fresh multi-MB tensor per layer costs page faults that, measured on
        # CPU (32 decodes x 320 keys), tripled the gather time. Safe because
        # one forward runs at a time and each gather is consumed by the SDPA
        # call right after it.
        self._workspace: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._workspace.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._workspace[name] = buf
        return buf[:numel]

    def _gather_kv(self, k_cache, v_cache, block_index):
        """-> (k, v) views [P, KVH, nb*bs, D] into the workspace."""
        numel = block_index.numel() * k_cache[0].numel()
        return (_gather(k_cache, block_index, self._buffer("k", numel, k_cache)),
                _gather(v_cache, block_index, self._buffer("v", numel, v_cache)))

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):
        store_kv(k, v, k_cache, v_cache, meta)
        t, h, d = q.shape
        kvh = k.shape[1]
        out = torch.empty_like(q)
        if meta.decode is not None:
            _paged_decode(q, k_cache, v_cache, meta.decode, scale, out)
        for g in meta.groups:
            if g.token_index is not None:
                ks, vs = self._gather_kv(k_cache, v_cache, g.block_index)
                out.index_copy_(0, g.token_index, _decode(q, ks, vs, g, kvh, scale))
                continue
            qs = q[g.token_start:g.token_end].transpose(0, 1).unsqueeze(0)      # [1, H, q, D]
            if g.block_index is None:
                ks = k[g.token_start:g.token_end].transpose(0, 1).unsqueeze(0)  # [1, KVH, q, D]
                vs = v[g.token_start:g.token_end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                   enable_gqa=True)
            else:
                ks, vs = self._gather_kv(k_cache, v_cache, g.block_index)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=g.mask, scale=scale,
                                                   enable_gqa=True)
            out[g.token_start:g.token_end] = o[0].transpose(0, 1)
        return out


def _paged_decode(q, k_cache, v_cache, rows: DecodeRows, scale: float, out: torch.Tensor) -> None:
    """Decode rows of q [T, H, D] -> their rows of out, read straight from the paged cache."""
    from formwork.kernels.cpu_decode_attention import paged_decode_attention

    if rows.token_index is None:
        paged_decode_attention(q, k_cache, v_cache, rows.block_table, rows.seq_lens, scale, out=out)
        return
    o = paged_decode_attention(q.index_select(0, rows.token_index), k_cache, v_cache,
                               rows.block_table, rows.seq_lens, scale)
    out.index_copy_(0, rows.token_index, o)


def _gather(cache: torch.Tensor, block_index: torch.Tensor, out: torch.Tensor | None = None
            ) -> torch.Tensor:
    """cache [N, bs, KVH, D], block_index [P, nb] -> [P, KVH, nb*bs, D] (a view
    of `out`, flat with P*nb*bs*KVH*D elements, when given)."""
    p, nb = block_index.shape
    n, bs, kvh, d = cache.shape
    flat = cache.view(n, bs * kvh * d)
    if out is not None:
        out = out.view(p * nb, bs * kvh * d)
    rows = torch.index_select(flat, 0, block_index.view(-1), out=out)  # 2x faster than cache[idx]
    return rows.view(p, nb * bs, kvh, d).transpose(1, 2)


def _decode(q, ks, vs, g: AttnGroup, kvh: int, scale: float) -> torch.Tensor:
    """One query per sequence against its gathered ks/vs [P, KVH, L, D]; the G
    query heads sharing a KV head are folded into the query axis, so no K/V
    expansion is needed. Returns [P, H, D]."""
    p = g.token_index.shape[0]
    _, h, d = q.shape
    qg = q.index_select(0, g.token_index).view(p, kvh, h // kvh, d)          # [P, KVH, G, D]
    o = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=g.mask, scale=scale)
    return o.reshape(p, h, d)
