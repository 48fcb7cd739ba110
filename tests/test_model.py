"""formwork's Llama over paged KV vs HF transformers (the reference)."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from formwork.gpu.attention import (AttentionMetadata, allocate_kv_cache, copy_kv_to_cache,
                                    flatten_batch)
from formwork.gpu.attention_torch import TorchAttentionBackend
from formwork.gpu.loader import load_model
from formwork.gpu.model_files import load_tokenizer
from formwork.gpu.cpu_linear import pack_linears, packing_supported
from formwork.gpu.model import CPU_FUSED_OPS, ModelConfig
from formwork.kernels import cpu_fused_ops

CPU = torch.device("cpu")


def gather_sdpa() -> TorchAttentionBackend:
    """Every decode through padded SDPA groups (a fresh workspace per use)."""
    return TorchAttentionBackend(paged_decode=False)


class PagedSeqs:
    """Feeds fixed token sequences through the model chunk by chunk (teacher
    forcing), with shuffled, non-contiguous block ids per sequence."""

    def __init__(self, model, seqs: list[torch.Tensor], block_size: int, seed: int = 0):
        cfg = model.config
        self.model, self.seqs, self.bs = model, seqs, block_size
        need = sum(-(-len(s) // block_size) for s in seqs)
        free = list(range(need + 7))
        random.Random(seed).shuffle(free)
        self.tables = [[free.pop() for _ in range(-(-len(s) // block_size))] for s in seqs]
        self.caches = allocate_kv_cache(cfg.num_hidden_layers, need + 7, block_size,
                                        cfg.num_key_value_heads, cfg.head_dim,
                                        model.model.embed_tokens.weight.dtype, CPU)
        self.done = [0] * len(seqs)
        self.logits: list[list[torch.Tensor]] = [[] for _ in seqs]

    def step(self, chunks: dict[int, int]) -> AttentionMetadata:
        """Run one batch: sequence i gets its next `chunks[i]` tokens (in index order)."""
        order = sorted(chunks)
        qlens = [chunks[i] for i in order]
        slens = [self.done[i] + chunks[i] for i in order]
        meta = self.model.attn_backend.build_metadata(qlens, slens, [self.tables[i] for i in order],
                                                      self.bs, CPU)
        ids = torch.cat([self.seqs[i][self.done[i]:s] for i, s in zip(order, slens)])
        pos = torch.cat([torch.arange(self.done[i], s) for i, s in zip(order, slens)])
        logits = self.model.compute_logits(self.model(ids, pos, self.caches, meta))
        for i, piece in zip(order, logits.split(qlens)):
            self.logits[i].append(piece)
            self.done[i] += chunks[i]
        return meta

    def all_logits(self, i: int) -> torch.Tensor:
        return torch.cat(self.logits[i])


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    ours = load_model(tiny_model_dir, dtype=torch.float32, device=CPU, attn_backend=gather_sdpa())
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return ours, ref


def hf_logits(ref, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(ids[None]).logits[0].float()


def test_config_from_tiny_dir(tiny):
    cfg = tiny[0].config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (2, 64, 4, 2, 16, 49152)
    assert cfg.tie_word_embeddings and tiny[0].lm_head.weight is tiny[0].model.embed_tokens.weight


def test_packed_prefill_matches_hf(tiny):
    ours, ref = tiny
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 49152, (n,), generator=g) for n in (5, 37, 18)]
    run = PagedSeqs(ours, seqs, block_size=8)
    run.step({0: 5, 1: 37, 2: 18})
    for i, s in enumerate(seqs):
        torch.testing.assert_close(run.all_logits(i), hf_logits(ref, s), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_mixed_decode_match_hf(tiny):
    ours, ref = tiny
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 49152, (n,), generator=g) for n in (30, 26, 16, 14)]
    run = PagedSeqs(ours, seqs, block_size=4, seed=3)
    run.step({0: 11, 1: 21, 2: 5})            # chunk, full prefill, chunk
    run.step({0: 19, 1: 1, 2: 1, 3: 9})       # rest on cached prefix, decodes, new prefill
    run.step({2: 6, 3: 1})                    # chunk on top of a decoded prefix + decode
    while any(run.done[i] < len(s) for i, s in enumerate(seqs)):
        run.step({i: 1 for i, s in enumerate(seqs) if run.done[i] < len(s)})
    for i, s in enumerate(seqs):
        torch.testing.assert_close(run.all_logits(i), hf_logits(ref, s), atol=1e-4, rtol=1e-4)


def _naive_paged_attention(q, k_cache, v_cache, qlens, slens, tables, bs, scale):
    """Per-sequence reference: gather the context token by token, expand GQA heads."""
    outs, off = [], 0
    for ql, sl, table in zip(qlens, slens, tables):
        slots = [table[p // bs] * bs + p % bs for p in range(sl)]
        k = k_cache.view(-1, *k_cache.shape[2:])[slots]            # [sl, KVH, D]
        v = v_cache.view(-1, *v_cache.shape[2:])[slots]
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q[off:off + ql], k) * scale
        qpos = torch.arange(sl - ql, sl)[:, None]
        scores = scores.masked_fill(torch.arange(sl)[None, :] > qpos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        off += ql
    return torch.cat(outs)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_torch_backend_matches_naive_reference(heads, kv_heads):
    """Decode rows of very different lengths (several padded groups), chunked and
    fresh prefills in one batch; slot -1 rows are not stored."""
    torch.manual_seed(0)
    bs, d, nblocks = 4, 8, 96
    qlens = [1, 1, 7, 1, 1, 1, 1, 5, 1, 1]
    slens = [3, 90, 7, 2, 60, 5, 4, 20, 33, 1]
    perm = torch.randperm(nblocks).tolist()
    tables = []
    for sl in slens:
        tables.append([perm.pop() for _ in range(-(-sl // bs))])
    k_cache = torch.randn(nblocks, bs, kv_heads, d)
    v_cache = torch.randn(nblocks, bs, kv_heads, d)
    t = sum(qlens)
    q, k, v = torch.randn(t, heads, d), torch.randn(t, kv_heads, d), torch.randn(t, kv_heads, d)
    backend = gather_sdpa()
    meta = backend.build_metadata(qlens, slens, tables, bs, CPU)
    assert len([g for g in meta.groups if g.token_index is not None]) >= 2
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    expect_k.view(-1, kv_heads, d)[meta.slot_mapping] = k
    expect_v.view(-1, kv_heads, d)[meta.slot_mapping] = v
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale=d ** -0.5)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
    ref = _naive_paged_attention(q, k_cache, v_cache, qlens, slens, tables, bs, d ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_slot_minus_one_rows_are_not_written():
    bs, kvh, d = 4, 2, 8
    k_cache, v_cache = torch.zeros(8, bs, kvh, d), torch.zeros(8, bs, kvh, d)
    # sequence 0: 6 new tokens, its second block id is negative -> positions 4, 5 unstored
    meta = AttentionMetadata.from_flat(flatten_batch([6, 1], [6, 3], [[2, -1], [5]], bs), CPU)
    assert meta.slot_mapping.tolist() == [8, 9, 10, 11, -1, -1, 22]
    k = torch.arange(1, 8, dtype=torch.float32)[:, None, None].expand(7, kvh, d).contiguous()
    copy_kv_to_cache(k, k.clone(), k_cache, v_cache, meta)
    written = k_cache.view(-1, kvh, d)[:, 0, 0]
    assert written.nonzero().flatten().tolist() == [8, 9, 10, 11, 22]
    assert written[[8, 9, 10, 11, 22]].tolist() == [1, 2, 3, 4, 7]
    assert torch.equal(k_cache, v_cache)


def test_metadata_fields():
    meta = AttentionMetadata.from_flat(flatten_batch([3, 1, 2], [3, 9, 6], [[4], [7, 1, 0], [2, 6]], 4), CPU)
    assert meta.query_start_loc.tolist() == [0, 3, 4, 6]
    assert meta.seq_lens.tolist() == [3, 9, 6]
    assert meta.block_table.dtype == torch.int32 and meta.block_table.shape == (3, 3)
    # positions: seq0 0..2, seq1 8, seq2 4..5
    assert meta.slot_mapping.tolist() == [16, 17, 18, 0, 24, 25]
    assert (meta.max_query_len, meta.max_seq_len) == (3, 9)


def _chat_ids(tok, text: str) -> torch.Tensor:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    return torch.tensor(ids)


PROMPTS = ["Hi", "What is the capital of France? Answer in one word.",
           "Write a JSON object with a name and an age for a fictional person named Bob, who is a baker.",
           "List three colors."]


@pytest.mark.slow
def test_real_model_fp32_matches_hf(default_model_dir):
    ours = load_model(default_model_dir, dtype=torch.float32, device=CPU, attn_backend=gather_sdpa())
    ref = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    tok = load_tokenizer(default_model_dir)
    seqs = [_chat_ids(tok, p) for p in PROMPTS]
    assert len({len(s) for s in seqs}) == len(seqs)
    run = PagedSeqs(ours, seqs, block_size=16, seed=5)
    run.step({0: len(seqs[0]), 1: 17, 2: len(seqs[2]), 3: 30})
    run.step({1: len(seqs[1]) - 17, 3: len(seqs[3]) - 30})
    worst = 0.0
    for i, s in enumerate(seqs):
        mine, theirs = run.all_logits(i), hf_logits(ref, s)
        assert torch.equal(mine.argmax(-1), theirs.argmax(-1))
        worst = max(worst, (mine - theirs).abs().max().item())
    print(f"real model fp32 max |logit diff| vs HF: {worst:.2e}")
    assert worst < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("cpu_fast_path", [False, True], ids=["torch-ops", "packed+fused"])
def test_real_model_bf16_smoke(default_model_dir, cpu_fast_path):
    # cpu_fast_path: what the executor does on a bf16 CPU (gpu/cpu_linear.py,
    # kernels/cpu_fused_ops.py). oneDNN packs bf16 weights only on CPUs with
    # AVX-512 (or AVX-NE-CONVERT); elsewhere the executor keeps F.linear, and so does this.
    assert not cpu_fast_path or cpu_fused_ops.available()
    ours = load_model(default_model_dir, dtype=torch.bfloat16, device=CPU, attn_backend=gather_sdpa(),
                      ops=CPU_FUSED_OPS if cpu_fast_path else None)
    if cpu_fast_path and packing_supported(torch.bfloat16, CPU):
        assert pack_linears(ours) == 4 * ours.config.num_hidden_layers + 1
    ref = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.bfloat16).eval()
    tok = load_tokenizer(default_model_dir)
    seqs = [_chat_ids(tok, p) for p in (PROMPTS[0], PROMPTS[3])]  # bf16 is slow on AVX2-only CPUs
    run = PagedSeqs(ours, seqs, block_size=16, seed=6)
    run.step({i: len(s) for i, s in enumerate(seqs)})
    for i, s in enumerate(seqs):
        mine, theirs = run.all_logits(i), hf_logits(ref, s)
        assert mine.dtype == torch.float32 and torch.isfinite(mine).all()
        # bf16 kernels differ in accumulation order: compare distributions, not bits
        kl = F.kl_div(mine.log_softmax(-1), theirs.log_softmax(-1), log_target=True,
                      reduction="none").sum(-1)
        print(f"bf16 max KL(HF || ours) prompt {i}: {kl.max().item():.2e}")
        assert kl.max().item() < 0.05, kl.max().item()
        assert mine[-1].argmax() == theirs[-1].argmax()


def test_model_config_llama3_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    hf_cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=131072,
                         rope_parameters=rope)
    from formwork.gpu.model import rope_inv_freq
    cfg = ModelConfig.from_dict(hf_cfg.to_dict())
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["factor"] == 8.0
    expect, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    torch.testing.assert_close(rope_inv_freq(cfg), expect)
    legacy = {**hf_cfg.to_dict(), "rope_parameters": None, "rope_theta": 500000.0,
              "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}}
    torch.testing.assert_close(rope_inv_freq(ModelConfig.from_dict(legacy)), expect)
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_dict({**hf_cfg.to_dict(), "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
