"""The prompt check: what an engine of this context and vocabulary serves.
Run by `LLM.generate` before it admits anything (through the engine or
EngineProcess's `check_prompt`) and by `EngineCore.add_request`, the engine's
guard: a prompt past the context or an id outside the vocabulary would corrupt
the batch. The HTTP entry says the same in OpenAI's terms before queueing
(serving_completion._prompts, params.context_max_tokens); the guard stays
behind it. See docs/architecture.md "Where input is checked"."""
from __future__ import annotations

from formwork.schemas.errors import ParamError


def check_prompt(ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """ValueError naming the parameter unless `ids` is a prompt the engine can serve."""
    if not ids:
        raise ParamError("prompt", "must not be empty")
    if len(ids) >= max_model_len:
        raise ParamError(
            "prompt", f"{len(ids)} tokens do not fit the context: max_model_len is "
            f"{max_model_len} (prompt plus at least one generated token)")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ParamError("prompt_token_ids", f"token id {bad} outside [0, {vocab_size})")
