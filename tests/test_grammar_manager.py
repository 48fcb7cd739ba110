"""StructuredOutputManager: async compile, cache, failures, timeouts, batched masks."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from xgrammar.testing import bitmask_to_bool_mask

from formwork.grammar.backend import allocate_bitmask, allowed_mask, set_only_tokens
from formwork.grammar.compile_pool import COMPILE_NICE_INCREMENT
from formwork.grammar.manager import StructuredOutputManager
from formwork.schemas.structured import StructuredOutputsParams as P

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
          "required": ["n", "s"], "additionalProperties": False}


@pytest.fixture
def manager(tokenizer):
    m = StructuredOutputManager(tokenizer, VOCAB, compile_timeout_s=20.0)
    yield m
    m.shutdown()


class SlowBackend:
    """Wraps a backend; compile() waits until released (or `delay_s` passes)."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.name, self.delay_s = inner, inner.name, delay_s
        self.release = threading.Event()
        self.calls = 0

    def compile(self, params):
        self.calls += 1
        self.release.wait(self.delay_s)
        return self.inner.compile(params)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


def wait(manager, rid, timeout=30.0):
    deadline = time.monotonic() + timeout
    while manager.status(rid) == "pending":
        assert time.monotonic() < deadline, "compile never finished"
        time.sleep(0.01)
    return manager.status(rid)


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_submit_does_not_block_and_shares_inflight_and_cached_compiles(manager, monkeypatch):
    slow = SlowBackend(manager._backends["llguidance"], delay_s=10.0)   # auto's pick for JSON
    monkeypatch.setitem(manager._backends, "llguidance", slow)
    start = time.monotonic()
    manager.submit("a", P(json=SCHEMA))
    manager.submit("b", P(json=SCHEMA))               # same key while compiling
    assert time.monotonic() - start < 5.0              # the compile takes 10 s: submit did not wait
    assert manager.status("a") == manager.status("b") == "pending"
    slow.release.set()
    assert wait(manager, "a") == "ready" and wait(manager, "b") == "ready"
    manager.submit("c", P(json=SCHEMA))               # cached: ready at once
    assert manager.status("c") == "ready"
    stats = manager.stats()
    assert slow.calls == 1 and stats.compiles == 1
    assert stats.inflight_shared == 1 and stats.cache_hits == 1
    for rid in "abc":                                 # separate matchers per request
        assert manager.accept_tokens(rid, ids(manager._tokenizer, '{"n":' + str(ord(rid))))
    assert manager._requests["a"].matcher is not manager._requests["b"].matcher


def test_failure_is_isolated_and_messages_name_keyword_and_path(manager):
    bad = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    msg = "unsupported JSON Schema keyword 'uniqueItems' at $.properties.tags"
    manager.submit("bad", P(json=bad))
    manager.submit("explicit", P(json=bad, backend="xgrammar"))
    manager.submit("meta", P(json={"type": "object", "properties": {"a": {"type": "strng"}}}))
    manager.submit("empty", P())
    manager.submit("good", P(json=SCHEMA))
    assert wait(manager, "bad") == "failed" and manager.error("bad").startswith(msg)
    assert wait(manager, "explicit") == "failed" and manager.error("explicit").startswith(msg)
    assert wait(manager, "meta") == "failed"
    assert manager.error("meta").startswith("invalid JSON Schema at $.properties.a.type")
    assert manager.status("empty") == "failed" and "exactly one of" in manager.error("empty")
    assert wait(manager, "good") == "ready"


def test_compile_timeout_fails_the_request(tokenizer, monkeypatch):
    m = StructuredOutputManager(tokenizer, VOCAB, compile_timeout_s=0.2)
    slow = SlowBackend(m._backends["xgrammar"], delay_s=5.0)
    monkeypatch.setitem(m._backends, "xgrammar", slow)
    m.submit("r", P(regex="[a-z]+", backend="xgrammar"))
    time.sleep(0.3)
    assert m.status("r") == "failed" and "longer than 0.2 s" in m.error("r")
    slow.release.set()
    m.shutdown()


def test_auto_takes_the_first_backend_that_enforces_the_constraint(manager, tokenizer):
    manager.submit("p", P(regex=r"\p{L}+"))          # xgrammar: no Unicode classes
    manager.submit("x", P(grammar='root ::= "a" | "b"'))
    manager.submit("j", P(json={"type": "string", "pattern": "^a+$"}))  # xgrammar: loose
    for rid in "pxj":
        assert wait(manager, rid) == "ready", manager.error(rid)
    # a request is ready once its future is done; the stats are counted by the future's
    # done-callback, which may run a moment later (seen on a busy box)
    deadline = time.monotonic() + 10
    while manager.stats().compiles < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert manager.stats().by_backend == {"llguidance": 2, "xgrammar": 1}
    assert manager.accept_tokens("p", ids(tokenizer, "h\u00e9llo"))
    assert not manager.accept_tokens("p", ids(tokenizer, "3"))


def test_bitmask_rows_match_per_request_matchers(manager, tokenizer):
    eos = tokenizer.eos_token_id
    reqs = {"j": P(json=SCHEMA, whitespace="compact"), "o": P(regex="[0-9]{2}", backend="outlines"),
            "c": P(choice=["yes", "no"]), "done": P(choice=["ok"])}
    for rid, params in reqs.items():
        manager.submit(rid, params)
    assert all(wait(manager, rid) == "ready" for rid in reqs)
    assert manager.accept_tokens("j", ids(tokenizer, '{"n":12,"s":"'))
    assert manager.accept_tokens("o", ids(tokenizer, "4"))
    assert manager.accept_tokens("done", ids(tokenizer, "ok") + [eos])
    assert manager.is_terminated("done") and not manager.is_terminated("j")
    order = ["o", "free", "j", "done", "c"]
    out = manager.fill_bitmask(order)
    assert out.shape == (5, VOCAB // 32) and out.dtype == torch.int32
    for row, rid in enumerate(order):
        expect = allocate_bitmask(1, VOCAB)
        if rid in reqs:
            manager._requests[rid].matcher.fill_bitmask(expect, 0)
        assert torch.equal(out[row], expect[0]), rid
    assert torch.nonzero(allowed_mask(out, 3, VOCAB)).flatten().tolist() == [eos]
    assert manager.fill_bitmask(["free"]) is None
    j_row, c_row = out[2].clone(), out[4].clone()
    # 80 distinct live xgrammar matchers: grows the buffer and takes the batched
    # (multi-threaded) fill path; every row must equal its one-by-one fill.
    many = []
    for i in range(40):
        manager.submit(f"j{i}", reqs["j"])
        manager.submit(f"c{i}", reqs["c"])
        many += [f"j{i}", f"c{i}"]
    assert all(wait(manager, rid) == "ready" for rid in many)
    for i in range(40):
        assert manager.accept_tokens(f"j{i}", ids(tokenizer, '{"n":12,"s":"'))
    big = manager.fill_bitmask(many)
    assert big.shape[0] == 80
    for row, rid in enumerate(many):
        assert torch.equal(big[row], j_row if rid[0] == "j" else c_row), rid
    # The same matcher listed many times (never two threads on one matcher).
    dup = manager.fill_bitmask(["j", "c"] * 40)
    for row in range(80):
        assert torch.equal(dup[row], j_row if row % 2 == 0 else c_row), row


def test_a_matcher_that_fails_mid_stream_ends_its_request_with_the_reason(manager, tokenizer,
                                                                          monkeypatch):
    """llguidance's per-token lexer fuel: a patterned string under a length bound
    ran out of it mid-generation (JSONSchemaBench Github_medium/o21142). Formwork's
    limits keep such a schema alive; if a matcher fails anyway, accept_tokens says
    no (nothing raises), the manager says why, and rollback/fill stay safe."""
    import formwork.grammar.llguidance_backend as llgb

    schema = {"type": "object", "required": ["s"], "properties": {"s": {
        "type": "string", "pattern": "^(?:\\S+\\s+){0,49}\\S+$", "maxLength": 500}}}
    text = ids(tokenizer, '{"s": "' + " ".join(f"word{i}" for i in range(40)) + '"}')

    def run(rid):
        manager.submit(rid, P(json=schema, backend="llguidance"))
        assert wait(manager, rid) == "ready"
        for n, tid in enumerate(text):
            manager.fill_bitmask([rid])
            if not manager.accept_tokens(rid, [tid]):
                return n
        manager.fill_bitmask([rid])
        return len(text) if manager.accept_tokens(rid, [tokenizer.eos_token_id]) else -1

    assert run("fuel") == len(text) and manager.is_terminated("fuel")
    monkeypatch.setitem(llgb.LIMITS, "step_lexer_fuel", 2000)   # the defaults failed the same way
    manager._cache.clear()
    stopped = run("starved")
    assert 0 < stopped < len(text)
    assert "grammar matcher failed" in manager.error("starved")
    assert "too many expressions" in manager.error("starved")
    matcher = manager._requests["starved"].matcher
    matcher.rollback(1)                                # no raise on a failed matcher
    assert not manager.accept_tokens("starved", [tokenizer.eos_token_id])
    only_eos = manager.fill_bitmask(["starved"])
    assert torch.nonzero(allowed_mask(only_eos, 0, VOCAB)).flatten().tolist() == \
        [tokenizer.eos_token_id]


def test_jump_forward_tokens_are_accepted_and_can_be_disabled(tokenizer):
    for enabled in (True, False):
        m = StructuredOutputManager(tokenizer, VOCAB, enable_jump_forward=enabled)
        m.submit("r", P(json=SCHEMA, whitespace="compact"))
        assert wait(m, "r") == "ready"
        forced = m.jump_forward_tokens("r")
        if not enabled:
            assert forced == []
            continue
        text = b"".join(m.vocab.token_bytes[t] for t in forced).decode()
        assert text and '{"n":'.startswith(text)
        rest = '{"n":1,"s":"x"}'[len(text):]
        assert m.accept_tokens("r", ids(tokenizer, rest) + [tokenizer.eos_token_id])
        assert m.is_terminated("r") and m.jump_forward_tokens("r") == []
        m.remove("r")
        assert "r" not in m._requests
        m.shutdown()


def test_bitmask_helpers_match_xgrammar_reference():
    vocab = 250                                   # the reference loops in Python
    bm = torch.randint(-2**31, 2**31 - 1, (2, 8), dtype=torch.int32)
    assert torch.equal(allowed_mask(bm, 1, vocab), bitmask_to_bool_mask(bm[1:2], vocab)[0])
    set_only_tokens(bm, 0, [0, 31, 32, vocab - 1])
    assert torch.nonzero(bitmask_to_bool_mask(bm[:1], vocab)[0]).flatten().tolist() == \
        [0, 31, 32, vocab - 1]


def test_compile_threads_run_at_a_lower_cpu_priority_than_the_engine_thread(manager, monkeypatch):
    """A compile storm yields the CPU to the forward: the compile thread's nice value
    is the engine thread's + COMPILE_NICE_INCREMENT (Linux: nice is per thread)."""
    import os

    seen = {}
    backend = manager._backends["llguidance"]
    original = backend.compile

    def spy(params):
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return original(params)

    monkeypatch.setattr(backend, "compile", spy)
    manager.submit("r-nice", P(json=SCHEMA))
    assert wait(manager, "r-nice") == "ready"
    engine_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen["nice"] == min(19, engine_nice + COMPILE_NICE_INCREMENT)
