"""Qwen2 checkpoints (Llama with biased q/k/v projections and an unused sliding
window in their config) and Qwen3 ones (Llama with an RMSNorm over each q and k
head, and a head_dim of its own) load into formwork's model and match HF
transformers' Qwen2/Qwen3ForCausalLM: logits over paged, chunked batches, and
greedy tokens through the engine. The tiny random models carry non-zero biases
and norm weights away from 1, so a dropped or misplaced one cannot pass."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import TOKENIZER_FILES
from formwork import LLM, SamplingParams
from formwork.gpu.loader import load_model
from formwork.gpu.model_files import check_model_dir
from test_model import CPU, PagedSeqs, gather_sdpa, hf_logits


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def qwen_dir(request, tmp_path_factory, default_model_dir):
    import transformers

    arch = request.param
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, use_sliding_window=False,
                  bos_token_id=1, eos_token_id=2)
    if arch == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=False, sliding_window=4096)
        model_cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.Qwen3Config(**common, tie_word_embeddings=True, head_dim=32,
                                          attention_bias=False)
        model_cls = transformers.Qwen3ForCausalLM
    out = tmp_path_factory.mktemp(f"tiny-{arch}")
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, out / name)
    return out


def test_config_biases_and_norms(qwen_dir):
    model = load_model(qwen_dir, dtype=torch.float32, device=CPU, attn_backend=gather_sdpa())
    cfg, attn = model.config, model.model.layers[0].self_attn
    assert cfg.rope_theta == 1e6 and attn.o_proj.bias is None
    if qwen_dir.name.startswith("tiny-qwen2"):
        assert cfg.attention_bias and not cfg.qk_norm and not cfg.tie_word_embeddings
        assert attn.qkv_proj.bias is not None and not hasattr(attn, "q_norm")
    else:
        assert cfg.qk_norm and not cfg.attention_bias and cfg.head_dim == 32
        assert attn.qkv_proj.bias is None and attn.q_norm.weight.shape == (32,)


def test_logits_match_hf_over_paged_chunked_batches(qwen_dir):
    from transformers import AutoModelForCausalLM

    ours = load_model(qwen_dir, dtype=torch.float32, device=CPU, attn_backend=gather_sdpa())
    ref = AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 49152, (n,), generator=g) for n in (23, 9, 17)]
    run = PagedSeqs(ours, seqs, block_size=4, seed=1)
    run.step({0: 10, 1: 9, 2: 17})
    run.step({0: 13})
    for i, s in enumerate(seqs):
        torch.testing.assert_close(run.all_logits(i), hf_logits(ref, s), atol=1e-4, rtol=1e-4)


def test_engine_greedy_tokens_equal_hf_generate(qwen_dir):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32).eval()
    prompts = [[5, 77, 1234, 9], [400, 401, 402, 403, 404, 405, 406]]
    llm = LLM(str(qwen_dir), engine_process=False, dtype="float32", num_kv_blocks=32, block_size=8)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                                min_new_tokens=8)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == want


def test_bf16_engine_runs_the_biased_projections(qwen_dir):
    """bf16 on CPU takes the packed oneDNN linears, which carry the biases themselves."""
    llm = LLM(str(qwen_dir), engine_process=False, dtype="bfloat16", num_kv_blocks=32, block_size=8)
    try:
        out = llm.generate({"prompt_token_ids": [5, 77, 1234, 9]},
                           SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 8
    finally:
        llm.shutdown()


def test_a_sliding_window_in_use_is_refused(qwen_dir, tmp_path):
    cfg = json.loads((qwen_dir / "config.json").read_text())
    check_model_dir(qwen_dir)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True}))
    with pytest.raises(ValueError, match="sliding-window attention"):
        check_model_dir(tmp_path, weights=False)
