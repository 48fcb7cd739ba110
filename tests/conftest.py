"""Session fixtures shared by tests: the real default model and a tiny random Llama."""
from __future__ import annotations

import os
import pathlib
import shutil

import pytest
import torch

# Without CUDA the Triton kernels run in the interpreter. Set here, before any
# test module is imported: triton patches `triton.language` for the interpreter
# only if the variable is set when it is first imported, so one module that
# imports `kernels.*` early (collection order) broke every later kernel test.
# The compile check's child process (test_kernels_compile) must not interpret.
if not torch.cuda.is_available() and os.environ.get("FORMWORK_COMPILE_CHILD") != "1":
    os.environ["TRITON_INTERPRET"] = "1"

# The references (HF transformers, torch ops) run in this process: under a cgroup
# CPU quota (a CI container on a many-core host) torch's default team of one thread
# per host core would spin under a quota that lets a few run; use what the engine uses.
from formwork.gpu.cpu_threads import usable_cpus  # noqa: E402

if (_cores := usable_cpus()) < torch.get_num_threads():
    torch.set_num_threads(_cores)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")


@pytest.fixture(scope="session")
def default_model_dir() -> pathlib.Path:
    """HF-format directory of the default model (converted from GGUF once, cached)."""
    from formwork.gpu.model_files import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer as the engine loads it (test modules that need
    the HF AutoTokenizer of the converted folder define their own)."""
    from formwork.gpu.model_files import load_model_tokenizer

    return load_model_tokenizer(None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, request) -> pathlib.Path:
    """A 2-layer random-weight Llama (hidden 64, 4 heads, 2 KV heads, head_dim 16)
    with the default model's tokenizer, saved in HF format. The tokenizer files
    come from $FORMWORK_TEST_TOKENIZER_DIR where set (a GPU machine, which has no
    default model: bench/gpu_check.sh carries them), else the default model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # non-trivial norm weights so RMSNorm scaling is exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out, safe_serialization=True)
    env = os.environ.get("FORMWORK_TEST_TOKENIZER_DIR")
    source = pathlib.Path(env) if env else request.getfixturevalue("default_model_dir")
    for name in TOKENIZER_FILES:
        src = source / name
        if src.is_file():
            shutil.copy(src, out / name)
    return out


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    """The offline LLM on the tiny model, in this process (one per test module)."""
    from formwork import LLM

    llm = LLM(str(tiny_model_dir), engine_process=False, dtype="float32", num_kv_blocks=64,
              block_size=8)
    yield llm
    llm.shutdown()
