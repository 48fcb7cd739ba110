"""Building the formwork Llama from an HF-format directory (see gpu/model_files.py
for finding that directory and its tokenizer, which need no torch)."""
from __future__ import annotations

import os
import pathlib

import torch
from safetensors.torch import load_file

from formwork.gpu.model import LlamaForCausalLM, ModelConfig
from formwork.gpu.model_files import check_model_dir
from formwork.gpu.tensor_parallel import parallelize, shard_config, shard_hf_weights


def load_model(model_dir: str | os.PathLike, *, dtype: torch.dtype, device: torch.device,
               attn_backend=None, ops=None, tp=None, load_format: str = "auto"):
    """Build `LlamaForCausalLM` from `model_dir`/config.json and its safetensors.
    `attn_backend` (an AttentionBackend, the model's for life) defaults to the
    torch backend, `ops` (gpu.model.LayerOps) to the torch reference ops. With `tp` (a gpu.tensor_parallel.TPGroup) the model is this
    rank's shard: the full
    checkpoint is read, then sliced (fine for small models; a per-rank read of
    only its slices would matter for large ones). `load_format="dummy"` reads
    config.json alone and draws random weights on `device` (benchmarks of a
    model shape whose checkpoint is not at hand)."""
    model_dir = pathlib.Path(model_dir)
    check_model_dir(model_dir, weights=load_format != "dummy")
    config = ModelConfig.from_dir(model_dir)
    if load_format == "dummy":
        if tp is not None:
            config = shard_config(config, tp.size)
        with torch.device("meta"):
            model = LlamaForCausalLM(config, attn_backend, ops)
        model.init_dummy_weights(dtype=dtype, device=torch.device(device),
                                 seed=0 if tp is None else tp.rank)
        if tp is not None:
            parallelize(model, tp)
        return model.eval()
    hf_weights: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        hf_weights.update(load_file(str(shard)))
    if tp is not None:
        hf_weights = shard_hf_weights(hf_weights, config, tp.rank, tp.size)
        config = shard_config(config, tp.size)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attn_backend, ops)
    model.load_hf_weights(hf_weights, dtype=dtype, device=torch.device(device))
    if tp is not None:
        parallelize(model, tp)
    return model.eval()
