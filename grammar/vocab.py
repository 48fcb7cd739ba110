"""Token bytes of a Hugging Face tokenizer, decoded once per process.

Special and added tokens (`<|im_start|>`, `<|endoftext|>`, ...) get no bytes:
a grammar never allows them, because the detokenizer drops them and the text
the client sees would then differ from the text the matcher checked.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum


class VocabKind(Enum):
    BYTE_LEVEL = "byte_level"        # GPT-2 byte-to-unicode alphabet ("Ġ" = space)
    BYTE_FALLBACK = "byte_fallback"  # sentencepiece: "▁" = space, "<0x0A>" = byte
    RAW = "raw"                      # token strings are the text itself


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's `bytes_to_unicode` (transformers' tokenization_gpt2)."""
    kept = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD))
            + list(range(0xAE, 0x100)))
    chars = list(kept)
    shift = 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + shift)
            shift += 1
    return {chr(c): b for b, c in zip(kept, chars)}


_UNICODE_TO_BYTE = _gpt2_unicode_to_byte()


def detect_kind(vocab: dict[str, int]) -> VocabKind:
    """Classify a vocabulary by its own spelling (as xgrammar does)."""
    if sum(f"<0x{b:02X}>" in vocab for b in range(256)) >= 128:
        return VocabKind.BYTE_FALLBACK
    if sum(ch in vocab for ch in _UNICODE_TO_BYTE) >= 128:
        in_alphabet = sum(all(ch in _UNICODE_TO_BYTE for ch in tok) for tok in vocab)
        if in_alphabet >= 0.99 * len(vocab):
            return VocabKind.BYTE_LEVEL
    return VocabKind.RAW


def decode_token(token: str, kind: VocabKind) -> bytes | None:
    """The bytes a token stands for; None if it is not spelled in `kind`'s alphabet."""
    if kind is VocabKind.BYTE_LEVEL:
        try:
            return bytes(_UNICODE_TO_BYTE[ch] for ch in token)
        except KeyError:
            return None
    if kind is VocabKind.BYTE_FALLBACK:
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])
        return token.replace("\u2581", " ").encode("utf-8")
    return token.encode("utf-8")


@dataclass(frozen=True, slots=True)
class TokenVocab:
    """Per-id token bytes for a model whose logits are `vocab_size` wide."""

    token_bytes: tuple[bytes | None, ...]   # [vocab_size]; None: never allowed
    encoded: tuple[str, ...]                # [vocab_size]; tokenizer spelling, "" if none
    kind: VocabKind
    eos_token_id: int
    special_ids: frozenset[int]
    add_prefix_space: bool          # the tokenizer prepends a space to the text it encodes
    _prefix_ids: frozenset[int] = field(default=frozenset(), repr=False)

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    @staticmethod
    def from_tokenizer(tokenizer, vocab_size: int) -> "TokenVocab":
        """Decode `tokenizer`'s vocabulary; ids >= its length stay None."""
        vocab: dict[str, int] = tokenizer.get_vocab()
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        eos = tokenizer.eos_token_id
        assert eos is not None and 0 <= eos < vocab_size, "tokenizer has no usable eos token"
        kind = detect_kind({t: i for t, i in vocab.items() if i not in special})
        token_bytes: list[bytes | None] = [None] * vocab_size
        encoded = [""] * vocab_size
        for tok, tid in vocab.items():
            if tid >= vocab_size:
                continue
            encoded[tid] = tok
            if tid not in special:
                token_bytes[tid] = decode_token(tok, kind)
        first = tokenizer.convert_ids_to_tokens(tokenizer.encode("a", add_special_tokens=False))
        add_prefix_space = bool(first) and first[0][:1] in ("\u2581", "\u0120")
        return TokenVocab(tuple(token_bytes), tuple(encoded), kind, eos,
                          frozenset(i for i in special if i < vocab_size), add_prefix_space,
                          _strict_prefix_ids(token_bytes))

    def is_strict_prefix_token(self, token_id: int) -> bool:
        """True if some longer ordinary token starts with this token's bytes, i.e.
        a tokenizer could merge this token with text that follows it."""
        return token_id in self._prefix_ids


def first_id_by_bytes(token_bytes: Sequence[bytes | None]) -> dict[bytes, int]:
    """{bytes: the lowest id spelled so}, over the ids that have bytes."""
    out: dict[bytes, int] = {}
    for tid, b in enumerate(token_bytes):
        if b is not None and b not in out:
            out[b] = tid
    return out


class PlainEncoder:
    """Text -> token ids as a model writing that text would spell it.

    A tokenizer's `encode` turns the spelling of a special or added token inside
    a text (`<|im_end|>` in a JSON key or enum value, `<tool_call>`) into that one
    token, which a grammar never allows (its bytes are None above) and which no
    output may contain. Here such spellings are written with ordinary tokens:
    `split_special_tokens` first, then, for an added token that option leaves
    whole, its text spelled greedily by the longest ordinary tokens."""

    def __init__(self, tokenizer, vocab: TokenVocab):
        self._tokenizer, self._vocab = tokenizer, vocab
        self._by_bytes: dict[bytes, int] | None = None   # built on first need
        self._max_len = 0
        self._split = True         # until a tokenizer without the option says otherwise

    def __call__(self, text: str) -> list[int]:
        if self._split:
            try:
                ids = list(self._tokenizer.encode(text, add_special_tokens=False,
                                                  split_special_tokens=True))
            except TypeError:      # a tokenizer without the option
                self._split = False
        if not self._split:
            ids = list(self._tokenizer.encode(text, add_special_tokens=False))
        tb, n = self._vocab.token_bytes, self._vocab.vocab_size
        if all(0 <= i < n and tb[i] is not None for i in ids):
            return ids
        out: list[int] = []
        for i in ids:
            if 0 <= i < n and tb[i] is not None:
                out.append(i)
            else:          # an id kept when its text has no ordinary spelling
                out.extend(self._spell(self._tokenizer.decode([i]).encode("utf-8")) or [i])
        return out

    def _spell(self, data: bytes) -> list[int]:
        """`data` in ordinary tokens, longest first ([] for bytes no token spells)."""
        if self._by_bytes is None:
            self._by_bytes = first_id_by_bytes(self._vocab.token_bytes)
            self._max_len = max(map(len, self._by_bytes), default=0)
        out, pos = [], 0
        while pos < len(data):
            for size in range(min(self._max_len, len(data) - pos), 0, -1):
                tid = self._by_bytes.get(data[pos:pos + size])
                if tid is not None:
                    out.append(tid)
                    pos += size
                    break
            else:
                return []
        return out


def _strict_prefix_ids(token_bytes: list[bytes | None]) -> frozenset[int]:
    """Ids whose bytes are a strict prefix of another token's bytes."""
    entries = sorted((b, i) for i, b in enumerate(token_bytes) if b)
    keys = [b for b, _ in entries]
    out = set()
    for b, i in entries:
        j = bisect.bisect_right(keys, b)   # first key > b
        while j < len(keys) and keys[j] == b:
            j += 1
        if j < len(keys) and keys[j].startswith(b):
            out.add(i)
    return frozenset(out)
