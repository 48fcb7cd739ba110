"""Torch attention backend, the reference and CPU serving path, and the
metadata only it reads: the step's work split into SDPA groups, and the rows
of the CPU paged decode kernel (kernels/cpu_decode_attention).

Prefill sequences: one SDPA call each. Decode rows: one call of the CPU paged
decode kernel (when it builds here), else padded gather + SDPA groups.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from formwork.gpu.attention import (AttentionBackend, AttentionMetadata, FlatBatch,
                                    copy_kv_to_cache, flatten_batch, to_device)
from formwork.kernels import cpu_decode_attention

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
class TorchAttentionMetadata(AttentionMetadata):
    groups: list[AttnGroup]     # SDPA calls: prefills, and decodes unless in `decode`
    decode: DecodeRows | None   # paged decode kernel rows (backend built with paged_decode)


def _decode_rows(flat: FlatBatch, device: torch.device) -> tuple[DecodeRows | None, np.ndarray]:
    """Decodes and short chunks (jump-forward tokens): one kernel row per token,
    causal by giving the token at position p a context of p + 1 keys (its K/V
    are stored before attention runs). Also returns which sequences they cover."""
    q, s = flat.query_lens, flat.seq_lens
    short = q <= _PAGED_MAX_QUERY
    if short.all() and (q == 1).all():
        return DecodeRows(None, to_device(flat.block_table, device, torch.int32),
                          to_device(s, device, torch.int32)), short
    if not short.any():
        return None, short
    rows = np.nonzero(short[flat.seq_of_token])[0]
    seq = flat.seq_of_token[rows]
    return DecodeRows(to_device(rows, device), to_device(flat.block_table[seq], device, torch.int32),
                      to_device(flat.positions[rows] + 1, device, torch.int32)), short


def _decode_groups(flat: FlatBatch, block_size: int, device, keep: np.ndarray) -> list[AttnGroup]:
    """Decode rows of kept sequences -> padded groups of similar context length."""
    q, s, nblocks = flat.query_lens, flat.seq_lens, -(-flat.seq_lens // block_size)
    decodes = np.nonzero((q == 1) & keep)[0]
    decodes = decodes[np.argsort(s[decodes], kind="stable")]
    groups: list[AttnGroup] = []
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
            token_index=to_device(flat.query_start_loc[idx], device), token_start=0, token_end=0,
            block_index=to_device(flat.block_table[idx, :nb], device),
            mask=to_device(mask[:, None, None, :], device, torch.bool)))
        start = end
    return groups


def _prefill_groups(flat: FlatBatch, block_size: int, device, keep: np.ndarray) -> list[AttnGroup]:
    """Each kept sequence with more than one new token -> one group."""
    q, s, qsl = flat.query_lens, flat.seq_lens, flat.query_start_loc
    groups: list[AttnGroup] = []
    for i in np.nonzero((q > 1) & keep)[0]:
        a, b, ctx = int(qsl[i]), int(qsl[i + 1]), int(s[i])
        if q[i] == ctx:  # no cached prefix: causal attention over the new tokens only
            groups.append(AttnGroup(None, a, b, None, None))
            continue
        nb = -(-ctx // block_size)
        keys = np.arange(nb * block_size)
        rows = np.arange(ctx - q[i], ctx)                              # query positions
        mask = keys[None, :] <= rows[:, None]                         # [q, L]
        groups.append(AttnGroup(None, a, b, to_device(flat.block_table[i:i + 1, :nb], device),
                                to_device(mask[None, None], device, torch.bool)))
    return groups


class TorchAttentionBackend(AttentionBackend):
    """Host-built work split per step, so never graph-captured."""

    name = "torch"

    def __init__(self, paged_decode: bool | None = None):
        """paged_decode: None -> use the CPU decode kernel if it can be built."""
        if paged_decode is None:
            paged_decode = cpu_decode_attention.available()
        self.paged_decode = paged_decode
        # Gathered K/V land in two reused buffers instead of fresh tensors: a
        # fresh multi-MB tensor per layer costs page faults that, measured on
        # CPU (32 decodes x 320 keys), tripled the gather time. Safe because
        # one forward runs at a time and each gather is consumed by the SDPA
        # call right after it.
        self._workspace: dict[str, torch.Tensor] = {}

    def build_metadata(self, query_lens, seq_lens, block_tables, block_size,
                       device) -> TorchAttentionMetadata:
        """Common fields plus `decode` (with paged_decode: decodes and short chunks)
        and `groups` (every other sequence)."""
        flat = flatten_batch(query_lens, seq_lens, block_tables, block_size)
        dev = torch.device(device)
        decode, in_decode = None, np.zeros(len(flat.query_lens), dtype=bool)
        if self.paged_decode:
            decode, in_decode = _decode_rows(flat, dev)
        groups = (_decode_groups(flat, block_size, dev, ~in_decode)
                  + _prefill_groups(flat, block_size, dev, ~in_decode))
        return TorchAttentionMetadata.from_flat(flat, dev, groups=groups, decode=decode)

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

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchAttentionMetadata, scale):
        copy_kv_to_cache(k, v, k_cache, v_cache, meta)
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
    if rows.token_index is None:
        cpu_decode_attention.paged_decode_attention(q, k_cache, v_cache, rows.block_table,
                                                    rows.seq_lens, scale, out=out)
        return
    o = cpu_decode_attention.paged_decode_attention(q.index_select(0, rows.token_index), k_cache,
                                                    v_cache, rows.block_table, rows.seq_lens, scale)
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
