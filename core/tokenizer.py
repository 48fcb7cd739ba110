"""The gateway's door to the tokenizer: it may import core, never gpu."""
from __future__ import annotations


def load_tokenizer(model: str | None):
    """HF tokenizer (with chat template) of `model` (None -> the default model)."""
    from formwork.gpu.loader import load_tokenizer as _load, resolve_model

    return _load(resolve_model(model))
