"""One request's constraint cannot stall the engine: xgrammar's parser keeps every
way an ambiguous constraint can split the text so far, and for nested repetitions
that can match the same text that work grows token after token (`(([a-z]*)*)*`:
twice the time each token; a random 60-character regex: a 13 s mask at its 16th
token), on the engine thread, for every request in the batch. A matcher that runs
past a step limit or its request's budget fails; the engine ends that request with
the error and the others go on."""
from __future__ import annotations

import random
import time

import pytest
import regex
import torch

from formwork import LLM, SamplingParams, StructuredOutputsParams as SO
from formwork.grammar import xgrammar_backend
from formwork.grammar.backend import allocate_bitmask, allowed_mask
from formwork.grammar.selection import choose_backend
from formwork.grammar.vocab import TokenVocab
from formwork.grammar.xgrammar_backend import XGrammarBackend

AMBIGUOUS = "(([a-z]*)*)*"
EVERYDAY = r"(\w+\s?)*"          # words and single spaces: xgrammar 25-45 ms a mask


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return TokenVocab.from_tokenizer(tokenizer, 49152)


@pytest.fixture(scope="module")
def backend(vocab):
    return XGrammarBackend(vocab)


def _fullmatch(pattern: str, text: str) -> bool:
    """Python's `re` backtracks without bound on these patterns when a text does not
    match (a hang, not a failure): the `regex` package, with a timeout, instead
    (the outputs hold ASCII word characters and spaces, read alike by both)."""
    return regex.fullmatch(pattern, text, timeout=10) is not None


def _walk(backend, vocab, pattern: str, steps: int, fill: bool = True):
    """Random letters under the mask until the matcher refuses; (tokens, seconds)."""
    m = backend.compile(SO(regex=pattern)).new_matcher()
    letters = [i for i, b in enumerate(vocab.token_bytes) if b and b.isalpha() and b.islower()]
    row, rng, start = allocate_bitmask(1, vocab.vocab_size), random.Random(0), time.perf_counter()
    for n in range(steps):
        if fill:
            m.fill_bitmask(row, 0)
            allowed = allowed_mask(row, 0, vocab.vocab_size)
            assert all(allowed[t] for t in letters[:50])
        if not m.accept_tokens([rng.choice(letters)]):
            return m, n, time.perf_counter() - start
    return m, steps, time.perf_counter() - start


@pytest.mark.parametrize("fill", [True, False], ids=["masked", "deferred"])
def test_an_ambiguous_regex_fails_its_matcher_in_bounded_time(backend, vocab, fill):
    m, n, seconds = _walk(backend, vocab, AMBIGUOUS, 2000, fill)
    assert n < 2000 and "too ambiguous" in m.error, (n, seconds)
    assert not m.accept_tokens([vocab.eos_token_id])      # refuses from then on
    assert m.jump_forward_string() == ""


def test_an_ordinary_regex_never_trips_the_limits(backend, vocab):
    m, n, _ = _walk(backend, vocab, "[a-z]+(, [a-z]+)*", 300)
    assert n == 300 and m.error == ""


class _Descheduled:
    """xgrammar's matcher on a busy box: each mask waits `wait_s` (the thread is not
    running: another process has the core) before the same work."""

    def __init__(self, native, wait_s: float):
        self._native, self._wait_s = native, wait_s

    def fill_next_token_bitmask(self, bitmask, row):
        time.sleep(self._wait_s)
        return self._native.fill_next_token_bitmask(bitmask, row)

    def __getattr__(self, name):
        return getattr(self._native, name)


def test_a_busy_box_does_not_count_against_a_constraint(backend, vocab, monkeypatch):
    """The limits count the CPU time of the grammar's own work: on a box six times
    oversubscribed the wall clock of an email format's masks (20-33 ms each here) ran
    past the budget in 40 tokens, and a mask the thread waited 0.5 s for failed its
    request as 'too ambiguous'."""
    monkeypatch.setattr(xgrammar_backend, "BUDGET_BASE_S", 0.3)
    m = backend.compile(SO(regex="[a-z]+")).new_matcher()
    m.native = _Descheduled(m.native, wait_s=0.6)     # past the 0.5 s step limit, and the budget
    a = vocab.token_bytes.index(b"a")
    row = allocate_bitmask(1, vocab.vocab_size)
    for _ in range(2):
        m.fill_bitmask(row, 0)
        assert m.accept_tokens([a]) and m.error == ""


def test_the_budget_counts_tokens_kept_not_rolled_back(backend, vocab, monkeypatch):
    """The per-request budget grows with the tokens kept: a check that accepts and
    rolls back (deferred masks) spends time but earns no allowance."""
    monkeypatch.setattr(xgrammar_backend, "BUDGET_BASE_S", 0.0)
    monkeypatch.setattr(xgrammar_backend, "BUDGET_PER_TOKEN_S", 0.002)
    m = backend.compile(SO(regex="[a-z]+")).new_matcher()
    a = vocab.token_bytes.index(b"a")
    for _ in range(5000):                 # accept + rollback: no token kept
        if not m.accepts(a):
            break
    assert "over 1 tokens" in m.error     # the one being checked; counted 5000 it would pass


def test_the_engine_ends_only_the_ambiguous_request(tiny_model_dir):
    """Served by xgrammar (asked for by name), the ambiguous regex fails its two
    requests and nothing else; under `auto` the same regex, and an everyday one
    xgrammar also failed on, go to llguidance and run to max_tokens matching."""
    llm = LLM(str(tiny_model_dir), engine_process=False, dtype="float32", num_kv_blocks=128)
    xgr = dict(regex=AMBIGUOUS, backend="xgrammar")
    try:
        sps = [SamplingParams(max_tokens=400, temperature=1.0, top_p=0.9, seed=1,   # masked
                              structured_outputs=SO(**xgr)),
               SamplingParams(max_tokens=400, temperature=0,                       # deferred
                              structured_outputs=SO(**xgr)),
               SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)]
        sps += [SamplingParams(max_tokens=400, temperature=temperature, seed=2,
                               structured_outputs=SO(regex=pattern))
                for pattern in (AMBIGUOUS, EVERYDAY) for temperature in (0, 1.0)]
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * len(sps), sps, use_tqdm=False)
        for o in outs[:2]:
            c = o.outputs[0]
            assert c.finish_reason == "error" and "xgrammar took" in c.error, (c.finish_reason, c.error)
        plain = outs[2].outputs[0]
        assert plain.finish_reason == "length" and len(plain.token_ids) == 30
        for o, sp in zip(outs[3:], sps[3:]):
            c = o.outputs[0]
            assert c.finish_reason in ("stop", "length") and not c.error, (c.finish_reason, c.error)
            # every prefix of a match is a match for both regexes, so a cut text matches too
            assert _fullmatch(sp.structured_outputs.regex, c.text), c.text
        assert llm.engine.kv_manager.usage == 0.0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("pattern", [AMBIGUOUS, EVERYDAY])
def test_auto_serves_ambiguous_regexes_with_llguidance(pattern, tokenizer, vocab):
    """Walked 300 tokens of letters and spaces under `auto`'s choice: no error, where
    xgrammar's matcher failed (test above) -- llguidance's lazily built DFA does not
    keep the ways the text can split."""
    from formwork.grammar.manager import build_backend
    params = SO(regex=pattern)
    assert choose_backend(params) == "llguidance"
    m = build_backend("llguidance", vocab, tokenizer).compile(params).new_matcher()
    pieces = [i for i, b in enumerate(vocab.token_bytes)
              if b and (b.isalpha() and b.islower() or b == b" ")]
    row, rng = allocate_bitmask(1, vocab.vocab_size), random.Random(0)
    kept = []
    for _ in range(300):
        m.fill_bitmask(row, 0)
        allowed = allowed_mask(row, 0, vocab.vocab_size)
        choices = [t for t in pieces[:2000] if allowed[t]]
        assert choices
        kept.append(rng.choice(choices))
        assert m.accept_tokens([kept[-1]])
    assert _fullmatch(pattern, b"".join(vocab.token_bytes[t] for t in kept).decode())
