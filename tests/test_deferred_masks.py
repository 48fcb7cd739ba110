"""Deferred grammar masks: a greedy or temperature-only constrained request is
sampled without its mask, the pick is checked by its matcher, and only a refused
pick is made again with the mask. The tokens must be exactly those an eager
mask gives, which rests on two facts tested here: a matcher's `accepts` agrees
with the mask it fills, and the sampler's second, masked pick over the same
logits and noise is the eager pick."""
from __future__ import annotations

import json
import pathlib
import random
import time

import jsonschema
import numpy as np
import pytest
import torch

from formwork import LLM, SamplingParams, StructuredOutputsParams as SO
from formwork.core.step_hooks import StepHooks
from formwork.grammar.backend import allocate_bitmask, allowed_token_ids
from formwork.grammar.manager import StructuredOutputManager, build_backend
from formwork.grammar.selection import choose_backend
from formwork.grammar.vocab import TokenVocab
from formwork.gpu.sampler import Sampler, SamplingBatch, mask_can_wait

VOCAB = 49152
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "n": {"type": "integer"},
                         "tier": {"enum": ["gold", "silver"]},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
          "required": ["name", "n", "tier", "tags"], "additionalProperties": False}
CONSTRAINTS = [SO(json=SCHEMA), SO(regex=r"[A-Z]{2}-[0-9]{3,5}( ok)?"), SO(choice=["alpha", "beta", "gamma"])]


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return TokenVocab.from_tokenizer(tokenizer, VOCAB)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar", "outlines"])
def test_accepts_agrees_with_the_mask(backend, tokenizer, vocab):
    """At every state of random walks, for the allowed tokens (a sample), a sample of
    the refused ones, every special token and eos: accepts(t) == bit t of the mask,
    and asking changes nothing (the mask is the same after)."""
    be = build_backend(backend, vocab, tokenizer)
    rng = random.Random(0)
    specials = sorted(vocab.special_ids | {vocab.eos_token_id})
    row = allocate_bitmask(1, VOCAB)
    checked = 0
    for params in CONSTRAINTS:
        so = SO(**{**{k: getattr(params, k) for k in ("json", "regex", "choice")},
                   "backend": backend})
        for walk in range(2):
            m = be.compile(so).new_matcher()
            for _ in range(14):
                m.fill_bitmask(row, 0)
                allowed = allowed_token_ids(row, 0, VOCAB)
                allowed_set = set(allowed)
                refused = [t for t in rng.sample(range(VOCAB), 1500) if t not in allowed_set]
                probe = rng.sample(allowed, min(len(allowed), 600)) + refused + specials
                for t in probe:
                    assert m.accepts(t) == (t in allowed_set), (backend, so.kind(), t, vocab.token_bytes[t])
                checked += len(probe)
                m.fill_bitmask(row, 0)
                assert allowed_token_ids(row, 0, VOCAB) == allowed, "accepts() moved the matcher"
                body = [t for t in allowed if t != vocab.eos_token_id]
                if not body:
                    break
                assert m.accept_tokens([rng.choice(body)])
    assert checked > 50_000


DATA = pathlib.Path(__file__).parent / "data" / "jsonschemabench"


def test_accepts_agrees_with_the_mask_on_corpus_schemas(tokenizer, vocab):
    """The same agreement on the checked-in JSONSchemaBench slice, each schema with
    the backend `auto` gives it, along random walks."""
    backends: dict = {}
    rng = random.Random(1)
    row = allocate_bitmask(1, VOCAB)
    specials = sorted(vocab.special_ids | {vocab.eos_token_id})
    served = 0
    for path in sorted(p for p in DATA.glob("*/*.json") if not p.name.endswith(".tests.json")):
        params = SO(json=json.loads(path.read_text()))
        try:
            name = choose_backend(params)
        except ValueError:
            continue                                  # refused up front: never served
        be = backends.setdefault(name, build_backend(name, vocab, tokenizer))
        m = be.compile(params).new_matcher()
        served += 1
        for _ in range(8):
            m.fill_bitmask(row, 0)
            allowed = allowed_token_ids(row, 0, VOCAB)
            allowed_set = set(allowed)
            probe = rng.sample(allowed, min(len(allowed), 150)) + specials + \
                [t for t in rng.sample(range(VOCAB), 300) if t not in allowed_set]
            for t in probe:
                assert m.accepts(t) == (t in allowed_set), (path.name, name, t, vocab.token_bytes[t])
            body = [t for t in allowed if t != vocab.eos_token_id]
            if not body:
                break
            assert m.accept_tokens([rng.choice(body)])
    assert served >= 15


def _batch(temps, seeds):
    n = len(temps)
    return SamplingBatch(temperature=torch.tensor(temps, dtype=torch.float32), top_p=None, top_k=None,
                         min_p=None, all_greedy=all(t == 0 for t in temps), seeds=seeds,
                         presence=None, frequency=None, repetition=None, output_token_ids=None,
                         all_token_ids=None, max_num_logprobs=None, num_logprobs=[None] * n)


@pytest.mark.parametrize("temps", [[0.0] * 5, [0.0, 0.7, 1.0, 1.3, 0.0], [1.0] * 5])
def test_resample_is_the_eager_masked_pick(temps):
    """Same logits, same seeds: deferring the mask (pick, check, pick again masked
    where refused) gives the eager pick on every row, seeded rows and rows drawing
    from the process-wide generator alike."""
    v, n = 3000, len(temps)
    gen = torch.Generator().manual_seed(1)
    differs = 0
    for trial in range(40):
        logits = torch.randn(n, v, generator=gen) * 3
        allowed = torch.rand(n, v, generator=gen) < (0.02 if trial % 2 else 0.6)
        allowed[torch.arange(n), torch.randint(0, v, (n,), generator=gen)] = True
        packed = np.packbits(allowed.numpy(), axis=1, bitorder="little")   # bit t % 8 of byte t // 8
        packed = np.pad(packed, ((0, 0), (0, -packed.shape[1] % 4)))
        bitmask = torch.from_numpy(packed.view(np.int32).copy())             # bit t % 32 of word t // 32
        seeds = [None, 7 + trial, None, 11 * trial, None][:n]
        rows = torch.arange(n)
        torch.manual_seed(trial)
        eager = Sampler()(logits.clone(), _batch(temps, seeds), bitmask, rows).token_ids
        torch.manual_seed(trial)
        s = Sampler()
        picks = s(logits.clone(), _batch(temps, seeds), keep=rows).token_ids
        refused = [i for i in range(n) if not allowed[i, picks[i]]]
        if refused:
            again = s.resample(torch.tensor(refused), bitmask[refused])
            for i, t in zip(refused, again):
                picks[i] = t
        differs += len(refused)
        assert picks == eager, (trial, picks, eager)
        assert all(allowed[i, t] for i, t in enumerate(picks))
    assert differs > 20          # the resample path really ran


def test_only_commuting_sampling_defers():
    assert mask_can_wait(SamplingParams(temperature=0))
    assert mask_can_wait(SamplingParams(temperature=0, top_p=0.5, top_k=3))   # greedy ignores them
    assert mask_can_wait(SamplingParams(temperature=0.8, seed=3))
    assert not mask_can_wait(SamplingParams(temperature=0.8, top_p=0.9))
    assert not mask_can_wait(SamplingParams(temperature=0.8, top_k=40))
    assert not mask_can_wait(SamplingParams(temperature=0.8, min_p=0.1))
    assert not mask_can_wait(SamplingParams(temperature=0, logprobs=2))


def test_a_refused_pick_backs_off(tokenizer):
    """After a refusal the request's mask stays eager for 2 steps, after a second
    refusal in a row for 4; an accepted pick resets the back-off; no deferral when
    budget-aware decoding narrows the mask to a closing path."""
    m = StructuredOutputManager(tokenizer, VOCAB)
    try:
        m.submit("r", SO(json=SCHEMA), budget=200)
        m.submit("b", SO(json={"type": "string"}), budget=2)     # '""' must come now
        for _ in range(200):
            if m.status("r") == "ready" and m.status("b") == "ready":
                break
            time.sleep(0.05)
        assert not m.can_defer("b")
        assert len(allowed_token_ids(m.fill_bitmask(["b"]), 0, VOCAB)) == 1   # steered, not filled
        row = allocate_bitmask(1, VOCAB)
        m._matcher("r").fill_bitmask(row, 0)
        good = allowed_token_ids(row, 0, VOCAB)[0]
        bad = next(t for t in range(VOCAB) if t not in set(allowed_token_ids(row, 0, VOCAB)))

        def eager_steps_after(token):
            assert m.can_defer("r")
            m.check_deferred("r", token)
            n = 0
            while not m.can_defer("r"):
                n += 1
            return n
        assert eager_steps_after(bad) == 2
        assert eager_steps_after(bad) == 4
        assert eager_steps_after(good) == 0
        assert eager_steps_after(bad) == 2
        st = m.stats()
        assert (st.deferred_checks, st.deferred_refused) == (4, 3)
    finally:
        m.shutdown()


def _run(model_dir, defer: bool, reqs):
    llm = LLM(str(model_dir), engine_process=False, dtype="float32", num_kv_blocks=256,
              defer_grammar_masks=defer, step_hooks=StepHooks(check_invariants=True))
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [sp for _, sp in reqs],
                            use_tqdm=False)
        assert llm.engine.kv_manager.usage == 0.0          # every block given back
        return ([list(o.outputs[0].token_ids) for o in outs], [o.outputs[0] for o in outs],
                llm.engine.structured.stats())
    finally:
        llm.shutdown()


def test_engine_tokens_are_the_same_deferred_or_not(tiny_model_dir):
    """The tiny random model picks badly, so most deferred picks are refused and
    picked again: every output (greedy, seeded temperature, with penalties, bias
    and min_tokens, a top-p request that stays eager, a free one) is token for
    token the eager engine's, and every finished JSON output validates."""
    mk = lambda **kw: SamplingParams(max_tokens=40, **kw)          # noqa: E731
    reqs = [([1, 2, 3, 4], mk(temperature=0, structured_outputs=SO(json=SCHEMA))),
            ([5, 6, 7], mk(temperature=0.9, seed=4, structured_outputs=SO(json=SCHEMA))),
            ([8, 9], mk(temperature=1.2, seed=9, structured_outputs=SO(regex=r"[a-z]{3,9}-[0-9]{2}"))),
            ([10, 11, 12], mk(temperature=0.8, top_p=0.9, seed=1, structured_outputs=SO(json=SCHEMA))),
            ([13, 14], mk(temperature=0, structured_outputs=SO(choice=["yes", "no", "maybe"]))),
            # penalties, a bias and min_tokens' bans commute with the mask too
            ([18, 19, 20], mk(temperature=0.9, seed=5, repetition_penalty=1.3, frequency_penalty=0.5,
                              logit_bias={7: 3.0, 9: -100}, min_tokens=3,
                              structured_outputs=SO(json=SCHEMA))),
            ([15, 16, 17], mk(temperature=0.7, seed=2))]
    on_ids, on_outs, on_stats = _run(tiny_model_dir, True, reqs)
    off_ids, _, off_stats = _run(tiny_model_dir, False, reqs)
    assert on_ids == off_ids
    assert on_stats.deferred_checks > 10 and on_stats.deferred_refused > 0
    assert off_stats.deferred_checks == 0
    finished = 0
    for (_, sp), out in zip(reqs, on_outs):
        so = sp.structured_outputs
        if so is not None and so.json is not None and out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMA)
            finished += 1
        if so is not None and so.choice is not None:
            assert out.text in so.choice
