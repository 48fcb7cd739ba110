"""The Triton attention backend inside the engine equals the torch backend.

Without CUDA the kernels run in the Triton interpreter (see test_kernels_bitmask),
so the model is the tiny random-weight Llama in fp32.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from formwork.gpu.attention import allocate_kv_cache  # noqa: E402
from formwork.gpu.attention_torch import TorchAttentionBackend  # noqa: E402
from formwork.gpu.attention_triton import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_backend_matches_torch_backend_on_built_metadata():
    """A decode, a fresh prefill, a chunk over cached blocks, and a decode whose
    block id is negative: slot -1, its K/V not stored (its output is undefined
    by contract, so it is not compared)."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs = 6, 2, 16, 8
    query_lens, seq_lens = [1, 11, 5, 1], [19, 11, 21, 9]
    tables = [[3, 0, 7], [5, 1], [2, 8, 4], [6, -1]]
    t = sum(query_lens)
    q, k, v = (torch.randn(t, h, dim, generator=gen).to(DEVICE)
               for h in (heads, kv_heads, kv_heads))
    (k_cache, v_cache), = allocate_kv_cache(1, 10, bs, kv_heads, dim, torch.float32, DEVICE)
    k_cache.copy_(torch.randn(k_cache.shape, generator=gen))
    v_cache.copy_(torch.randn(v_cache.shape, generator=gen))
    results = []
    for backend in (TorchAttentionBackend(paged_decode=False), TritonAttentionBackend()):
        meta = backend.build_metadata(query_lens, seq_lens, tables, bs, DEVICE)
        assert (meta.slot_mapping == -1).sum() == 1
        kc, vc = k_cache.clone(), v_cache.clone()
        out = backend.forward(q, k, v, kc, vc, meta, 0.25)
        results.append((out[:-1], kc, vc))
    (want_out, want_k, want_v), (out, kc, vc) = results
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=2e-5)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert not torch.equal(kc, k_cache)  # the store really happened


def _greedy(model, prompts, schedule, new_tokens, block_size=8):
    """Greedy decoding driven by hand: `schedule` lists prefill steps as
    {seq: tokens this step}; then every sequence decodes `new_tokens` tokens
    in one batch per step. Returns the generated ids per sequence."""
    cfg = model.config
    caches = allocate_kv_cache(cfg.num_hidden_layers, 32, block_size, cfg.num_key_value_heads,
                               cfg.head_dim, torch.float32, DEVICE)
    tables = [[5 + 7 * i + j for j in range(6)][::-1] for i in range(len(prompts))]
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)
    steps = schedule + [{i: 1 for i in range(len(prompts))}] * new_tokens
    for step in steps:
        order = sorted(step)
        ends = [done[i] + step[i] for i in order]
        meta = model.attn_backend.build_metadata([step[i] for i in order], ends,
                                                 [tables[i] for i in order], block_size, DEVICE)
        ids = torch.tensor([t for i, e in zip(order, ends) for t in tokens[i][done[i]:e]])
        pos = torch.cat([torch.arange(done[i], e) for i, e in zip(order, ends)])
        hidden = model(ids.to(DEVICE), pos.to(DEVICE), caches, meta)
        last = meta.query_start_loc[1:].long() - 1
        next_ids = model.compute_logits(hidden[last]).argmax(-1).tolist()
        for i, e, t in zip(order, ends, next_ids):
            done[i] = e
            if e == len(tokens[i]):  # the whole prompt (or last token) is in: sample
                tokens[i].append(t)
    return [t[len(p):] for t, p in zip(tokens, prompts)]


@pytest.mark.slow
def test_model_greedy_outputs_match_torch_backend(tiny_model_dir):
    """Tiny Llama, fp32: ragged prompts, a prefill split in two chunks (the
    second over cached blocks) batched with a decode, then batched decodes."""
    from formwork.gpu.loader import load_model

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (5, 23, 17)]
    schedule = [{0: 5, 1: 10}, {0: 1, 1: 13, 2: 17}]
    outputs = {}
    for backend in (TorchAttentionBackend(paged_decode=False), TritonAttentionBackend()):
        model = load_model(tiny_model_dir, dtype=torch.float32, device=torch.device(DEVICE),
                           attn_backend=backend)
        outputs[backend.name] = _greedy(model, prompts, schedule, new_tokens=4)
    assert [len(o) for o in outputs["torch"]] == [6, 5, 5]
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.slow
def test_greedy_outputs_match_torch_backend(tiny_model_dir):
    """Ragged prompts, chunked prefill (budget 16 tokens) over cached blocks, decodes."""
    from formwork import LLM, SamplingParams

    gen = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(0, 49152, (n,), generator=gen).tolist()}
               for n in (5, 23, 17)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_model_dir), dtype="float32", device=DEVICE, attention_backend=backend,
                  block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)
        outputs[backend] = [o.outputs[0].token_ids for o in
                            llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert all(len(ids) == 6 for ids in outputs["torch"])
    assert outputs["triton"] == outputs["torch"]
