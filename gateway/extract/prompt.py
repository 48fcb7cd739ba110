"""The engine-independent core of `formwork extract`: the options, the prompt for
one document, and fitting a long document into the context, measured by a
TokenMeter. offline.py (an in-process `LLM`) and server.py (--server) build on
these; cli.py is the command over both.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any, Protocol

from formwork.gateway.extract.inputs import Document
from formwork.gateway.extract.records import make_record
from formwork.schemas.sampling import SamplingParams
from formwork.schemas.structured import StructuredOutputsParams

DEFAULT_INSTRUCTIONS = (
    "Extract the information described by the JSON schema below from the document the user "
    "sends. Reply with one JSON object that follows the schema. Use only facts stated in the "
    "document.")


@dataclass(frozen=True, slots=True, kw_only=True)
class ExtractOptions:
    schema: dict
    model: Any = None           # the pydantic model --schema named, if any (records.py)
    instructions: str = DEFAULT_INSTRUCTIONS
    max_tokens: int = 512
    temperature: float = 0.0
    on_long: str = "truncate"   # "truncate" | "skip"

    def sampling_params(self) -> SamplingParams:
        """Raises ValueError naming the bad parameter."""
        return SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens,
                              structured_outputs=StructuredOutputsParams(json=self.schema))


def warn(msg: str) -> None:
    print(f"formwork extract: warning: {msg}", file=sys.stderr, flush=True)


# -- prompts --------------------------------------------------------------
def build_messages(text: str, opts: ExtractOptions) -> list[dict]:
    schema = json.dumps(opts.schema, ensure_ascii=False)
    return [{"role": "system", "content": f"{opts.instructions}\n\nJSON schema:\n{schema}"},
            {"role": "user", "content": text}]


class TokenMeter(Protocol):
    """The model's tokens, as the engine or server that runs the prompt counts them."""

    def count(self, messages: list[dict]) -> int:
        """Prompt tokens of `messages` under the chat template, generation prompt included."""

    def encode(self, text: str) -> list[int]:
        """`text` alone, no special tokens added."""

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class LocalMeter:
    """TokenMeter of an in-process HF tokenizer."""
    tokenizer: Any

    def count(self, messages: list[dict]) -> int:
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True,
                                                 add_generation_prompt=True, return_dict=False)
        return len(ids["input_ids"] if isinstance(ids, dict) else ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def fit_document(meter: TokenMeter, text: str, opts: ExtractOptions,
                 max_model_len: int) -> tuple[str, int, int]:
    """(text, prompt tokens with the whole document, prompt tokens with `text`):
    the document itself when its prompt leaves room for max_tokens, else its
    longest token prefix that does. ValueError when not even an empty one fits."""
    budget = max_model_len - opts.max_tokens
    full = meter.count(build_messages(text, opts))
    if full <= budget:
        return text, full, full
    ids = meter.encode(text)
    keep = len(ids) - (full - budget)
    while keep > 0:  # re-tokenizing the cut text can shift the count by a token or two
        cut = meter.decode(ids[:keep])
        n = meter.count(build_messages(cut, opts))
        if n <= budget:
            return cut, full, n
        keep -= n - budget
    raise ValueError(f"the instructions and schema leave no room for a document within "
                     f"max_model_len {max_model_len} minus --max-tokens {opts.max_tokens}")


def fitted_prompt(doc: Document, opts: ExtractOptions, meter: TokenMeter,
                  limit: int) -> tuple[list[dict], bool] | dict:
    """(messages, truncated) for a document whose prompt fits `limit` (max_model_len)
    or was cut to fit; else the record of a document that is not sent (--on-long
    skip, or no room at all). Warns on stderr about each long document."""
    try:
        text, full, n = fit_document(meter, doc.text, opts, limit)
    except ValueError as e:
        return make_record(doc, error=str(e))
    if n == full:
        return build_messages(text, opts), False
    why = f"{full} prompt tokens + --max-tokens {opts.max_tokens} > max_model_len {limit}"
    if opts.on_long == "skip":
        warn(f"{doc.id}: too long, skipped ({why})")
        return make_record(doc, error=f"document too long ({why}); skipped (--on-long skip)")
    warn(f"{doc.id}: too long, truncated to {n} prompt tokens ({why})")
    return build_messages(text, opts), True

