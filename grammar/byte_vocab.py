"""A vocabulary of the 256 bytes and an end token for llguidance: a grammar's parser
over a text's bytes, with no model's tokenizer (the output check parses a Lark
output with it; schema_values asks llguidance how it writes a number)."""
from __future__ import annotations

import functools


class ByteVocabulary:
    """What llguidance's TokenizerWrapper reads: 256 one-byte tokens and an end token."""
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"\xff[eos]"]
    special_token_ids = [256]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@functools.lru_cache(maxsize=1)
def byte_tokenizer():
    """The llguidance tokenizer of ByteVocabulary (built once: it is immutable)."""
    import llguidance as llg

    return llg.LLTokenizer(llg.TokenizerWrapper(ByteVocabulary()), n_vocab=257, slices=[])
