"""Jump-forward: emit the text a grammar forces without sampling it.

The forced string is tokenized the way the tokenizer would tokenize it. Its
last token is dropped when a longer token starts with it (the tokenizer could
merge it with what the model writes next), and tokens are accepted one by one
so only tokens the matcher allows are ever returned.
"""
from __future__ import annotations

from formwork.grammar.backend import Matcher
from formwork.grammar.vocab import TokenVocab


def forced_tokens(matcher: Matcher, tokenizer, vocab: TokenVocab) -> list[int]:
    """Accept and return the tokens of `matcher`'s forced continuation ([] if none)."""
    if matcher.is_terminated():
        return []
    text = matcher.jump_forward_string()
    if not text:
        return []
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    spelled = [vocab.token_bytes[i] if 0 <= i < vocab.vocab_size else None for i in ids]
    if any(b is None for b in spelled) or b"".join(spelled) != text.encode("utf-8"):
        return []   # e.g. a tokenizer that prepends a space to every text
    if ids and vocab.is_strict_prefix_token(ids[-1]):
        ids.pop()
    accepted: list[int] = []
    for tid in ids:
        if not matcher.accept_tokens([tid]):
            break
        accepted.append(tid)
    return accepted
