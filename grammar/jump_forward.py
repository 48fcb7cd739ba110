"""Jump-forward: emit the text a grammar forces without sampling it.

The forced string is tokenized the way the tokenizer would tokenize it. Its
last token is dropped when a longer token starts with it (the tokenizer could
merge it with what the model writes next), and tokens are accepted one by one
so only tokens the matcher allows are ever returned.
"""
from __future__ import annotations

from formwork.grammar.backend import Matcher
from formwork.grammar.vocab import PlainEncoder, TokenVocab


class ForcedTextEncoder:
    """Forced text -> the token ids to try, remembered per text.

    The same forced texts (key names, `","`) come back every step of every
    request of a schema, and a closing search (grammar/closing_search.py) meets each a
    dozen times: a tokenizer call costs ~45 us, a dict hit well under one. The
    result depends only on the text, so the cache changes no output. Bounded:
    emptied when it reaches `max_entries` (schemas come and go)."""

    def __init__(self, tokenizer, vocab: TokenVocab, max_entries: int = 8192):
        self._vocab, self._max = vocab, max_entries
        self._plain = PlainEncoder(tokenizer, vocab)
        self._ids: dict[str, tuple[int, ...]] = {}

    def ids(self, text: str) -> tuple[int, ...]:
        """`text` tokenized, without a last token a longer one could extend; () if
        the tokens do not spell `text` exactly (e.g. a tokenizer that prepends a space)."""
        got = self._ids.get(text)
        if got is None:
            got = self._encode(text)
            if len(self._ids) >= self._max:
                self._ids.clear()
            self._ids[text] = got
        return got

    def spelled(self, text: str) -> tuple[int, ...]:
        """`text` as the tokenizer spells it, every token (the last one too); () if
        the tokens do not spell `text` exactly. Not remembered: the closing search asks
        for whole paths, whose texts rarely repeat."""
        vocab = self._vocab
        ids = self._plain(text)
        spelled = [vocab.token_bytes[i] if 0 <= i < vocab.vocab_size else None for i in ids]
        if any(b is None for b in spelled) or b"".join(spelled) != text.encode("utf-8"):
            return ()
        return tuple(ids)

    def _encode(self, text: str) -> tuple[int, ...]:
        ids = list(self.spelled(text))
        if ids and self._vocab.is_strict_prefix_token(ids[-1]):
            ids.pop()
        return tuple(ids)


def forced_tokens(matcher: Matcher, encoder: ForcedTextEncoder) -> list[int]:
    """Accept and return the tokens of `matcher`'s forced continuation ([] if none)."""
    if matcher.is_terminated():
        return []
    text = matcher.jump_forward_string()
    if not text:
        return []
    accepted: list[int] = []
    for tid in encoder.ids(text):
        if not matcher.accept_tokens([tid]):
            break
        accepted.append(tid)
    return accepted
