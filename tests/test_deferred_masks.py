"""Deferred grammar masks: a greedy or temperature-only constrained request is
sampled without its mask, the pick is checked by its matcher, and only a refused
pick is made again with the mask. Greedy tokens must be exactly those an eager
mask gives and sampled ones must have exactly the masked distribution, which
rests on facts tested here: a matcher's `accepts` agrees with the mask it fills,
the sampler's masked re-pick over the same logits is the eager greedy pick, and
its accept-or-redraw frequencies are the masked softmax."""
from __future__ import annotations

import json
import pathlib
import random
import re
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


def _packed(allowed: torch.Tensor) -> torch.Tensor:
    """bool [n, v] -> int32 bitmask words (bit t % 32 of word t // 32)."""
    packed = np.packbits(allowed.numpy(), axis=1, bitorder="little")   # bit t % 8 of byte t // 8
    packed = np.pad(packed, ((0, 0), (0, -packed.shape[1] % 4)))
    return torch.from_numpy(packed.view(np.int32).copy())


def _deferred(logits, batch, allowed, bitmask, rescue: bool = True) -> list[int]:
    """Pick unmasked; a refused row takes its first allowed candidate (`rescue`), the
    rest are re-picked masked: what the engine does."""
    s, rows = Sampler(), torch.arange(logits.shape[0])
    picks = s(logits.clone(), batch, keep=rows).token_ids
    refused = [i for i in range(len(picks)) if not allowed[i, picks[i]]]
    if refused and rescue:
        left = []
        for i, cands in zip(refused, s.candidates(torch.tensor(refused), 8)):
            t = next((t for t in cands if allowed[i, t]), None)
            if t is None:
                left.append(i)
            else:
                picks[i] = t
        refused = left
    if refused:
        for i, t in zip(refused, s.resample(torch.tensor(refused), bitmask[refused])):
            picks[i] = t
    return picks


def test_candidates_are_in_masked_argmax_order():
    """A greedy row's candidates: higher logit first, ties by lower id (argmax's first
    maximum), nothing tied with the k-th value (a tie may lie outside the top k),
    no -inf; a sampled row gets none. So the first candidate a mask allows is the
    masked argmax: checked against apply-the-mask-then-argmax on random masks."""
    s = Sampler()
    logits = torch.full((3, 12), -5.0)
    logits[0, [7, 2, 9, 4]] = torch.tensor([3.0, 3.0, 1.0, 2.0])    # 2 and 7 tie
    logits[1, [1, 3, 5]] = torch.tensor([4.0, 0.5, 0.5])            # 3, 5 tie at the edge
    logits[2] = float("-inf")
    logits[2, 6] = 1.0
    s(logits.clone(), _batch([0, 0, 0], [None] * 3), keep=torch.arange(3))
    assert s.candidates(torch.arange(3), 4) == [[2, 7, 4], [1, 3, 5], [6]]   # 9 ties the edge
    assert s.candidates(torch.tensor([1]), 3) == [[1]]              # edge value 0.5: cut
    s(logits[:2].clone(), _batch([0, 0.8], [None, 1]), keep=torch.arange(2))
    greedy_row, sampled_row = s.candidates(torch.arange(2), 4)
    assert greedy_row == [2, 7, 4] and len(sampled_row) == 4      # draws, not a ranking
    assert s.candidates(torch.arange(2), 4)[1] == sampled_row     # the row's own uniforms
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        x = torch.randint(-3, 4, (1, 64), generator=g).float()      # many ties
        s(x.clone(), _batch([0], [None]), keep=torch.arange(1))
        allowed = torch.rand(64, generator=g) < 0.3
        cands = s.candidates(torch.arange(1), 8)[0]
        first = next((t for t in cands if allowed[t]), None)
        masked = x[0].masked_fill(~allowed, float("-inf"))
        if first is not None:
            assert first == int(masked.max(-1).indices)


def test_resample_is_the_eager_masked_pick_when_greedy():
    """Same logits: deferring the mask of greedy rows gives the eager pick on every
    row; sampled rows beside them always end on an allowed token."""
    temps, v, n = [0.0, 0.7, 0.0, 1.3, 0.0], 3000, 5
    gen = torch.Generator().manual_seed(1)
    refused = 0
    for trial in range(40):
        logits = torch.randn(n, v, generator=gen) * 3
        allowed = torch.rand(n, v, generator=gen) < (0.02 if trial % 2 else 0.6)
        allowed[torch.arange(n), torch.randint(0, v, (n,), generator=gen)] = True
        bitmask = _packed(allowed)
        batch = _batch(temps, [None, 7 + trial, None, None, None])
        eager = Sampler()(logits.clone(), batch, bitmask, torch.arange(n)).token_ids
        picks = _deferred(logits, batch, allowed, bitmask, rescue=trial % 2 == 0)
        refused += sum(not allowed[i, logits[i].argmax()] for i in (0, 2, 4))
        assert [picks[i] for i in (0, 2, 4)] == [eager[i] for i in (0, 2, 4)], trial
        assert all(allowed[i, t] for i, t in enumerate(picks))
        assert all(allowed[i, t] for i, t in enumerate(eager))
    assert refused > 20          # the resample path really ran


def test_spare_draws_follow_the_unmasked_distribution():
    """A sampled row's candidates are independent draws from softmax(logits / T):
    each position's frequencies over many rows, and two positions agree as often as
    independent draws do (sum of p squared)."""
    v, n, temp = 12, 20000, 0.9
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 3.0, 2.5, -1.0, 0.2, 1.1, -2.0]])
    ref = (logits[0] / temp).softmax(-1)
    s = Sampler()
    torch.manual_seed(5)
    s(logits.repeat(n, 1), _batch([temp] * n, [None] * n), keep=torch.arange(n))
    draws = torch.tensor(s.candidates(torch.arange(n), 8))       # [n, 8]
    assert draws.shape == (n, 8)
    for j in (0, 3, 7):
        freq = torch.bincount(draws[:, j], minlength=v).float() / n
        assert torch.allclose(freq, ref, atol=0.015), (j, freq, ref)
    same = (draws[:, 0] == draws[:, 1]).float().mean()
    assert abs(same - (ref ** 2).sum()) < 0.015


@pytest.mark.parametrize("temp", [0.7, 1.3])
def test_accept_or_redraw_has_the_masked_distribution(temp):
    """Sampled rows: the deferred pick (unmasked draw; when refused, the first allowed
    of the row's spare draws, else a masked redraw — and without the spare draws)
    and the eager masked pick all follow softmax(logits / T) over the allowed
    tokens; a disallowed token is never returned."""
    v, n = 12, 20000
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 3.0, 2.5, -1.0, 0.2, 1.1, -2.0]])
    allowed = torch.zeros(1, v, dtype=torch.bool)
    allowed[0, [1, 2, 4, 5, 9]] = True                    # the two likeliest tokens refused
    ref = torch.where(allowed[0], logits[0] / temp, torch.tensor(float("-inf"))).softmax(-1)
    many, mask = logits.repeat(n, 1), allowed.repeat(n, 1)
    bitmask = _packed(mask)
    batch = _batch([temp] * n, [None] * n)
    torch.manual_seed(3)
    for picks in (_deferred(many, batch, mask, bitmask), _deferred(many, batch, mask, bitmask, False),
                  Sampler()(many.clone(), batch, bitmask, torch.arange(n)).token_ids):
        freq = torch.bincount(torch.tensor(picks), minlength=v).float() / n
        assert (freq[~allowed[0]] == 0).all()
        assert torch.allclose(freq, ref, atol=0.015), (freq, ref)


def test_only_commuting_sampling_defers():
    assert mask_can_wait(SamplingParams(temperature=0))
    assert mask_can_wait(SamplingParams(temperature=0, top_p=0.5, top_k=3))   # greedy ignores them
    assert mask_can_wait(SamplingParams(temperature=0.8, seed=3))
    assert not mask_can_wait(SamplingParams(temperature=0.8, top_p=0.9))
    assert not mask_can_wait(SamplingParams(temperature=0.8, top_k=40))
    assert not mask_can_wait(SamplingParams(temperature=0.8, min_p=0.1))
    assert not mask_can_wait(SamplingParams(temperature=0, logprobs=2))


def test_llguidance_validates_a_checked_token_once(tokenizer, vocab):
    """The engine checks a deferred pick, then accepts it: one validation, not two;
    any state change in between forgets the check (a rolled-back state refuses)."""
    m = build_backend("llguidance", vocab, tokenizer).compile(SO(json=SCHEMA)).new_matcher()
    calls = []

    class Counting:
        def __init__(self, native):
            self._native = native

        def __getattr__(self, name):
            return getattr(self._native, name)

        def validate_tokens(self, ids):
            calls.append(list(ids))
            return self._native.validate_tokens(ids)
    m.native = Counting(m.native)
    brace, quote = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("{", '"'))
    assert m.accepts(brace) and m.accept_tokens([brace]) and len(calls) == 1
    assert m.accepts(quote)
    m.rollback(1)                                  # back before '{': '"' is not allowed
    assert not m.accept_tokens([quote]) and len(calls) == 3
    assert not m.accepts(quote) and m.accept_tokens([brace]) and len(calls) == 5


def test_a_refused_pick_is_deferred_again(tokenizer):
    """A refused pick leaves the request deferrable at the next step (no eager
    back-off: measured dearer than the redraws it saves, grammar/manager.can_defer);
    no deferral when budget-aware decoding narrows the mask to a closing path."""
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
        for token, ok in ((bad, False), (bad, False), (good, True), (bad, False)):
            assert m.can_defer("r")
            assert m.check_deferred("r", token) is ok
        assert m.can_defer("r")
        st = m.stats()
        assert (st.deferred_checks, st.deferred_refused) == (4, 3)
        # the first allowed of a candidate list, in its order; None if none is
        assert m.first_allowed("r", [bad, good, bad]) == good
        assert m.first_allowed("r", [bad]) is None
        assert m.stats().deferred_rescued == 1
    finally:
        m.shutdown()


def _run(model_dir, defer: bool, reqs):
    # a fixed thread count: runs compared token for token must sum their floats alike (the
    # adaptive count follows the box's load, and a suite beside another one moved it
    # between two runs, turning the near-flat random model's seeded draws)
    llm = LLM(str(model_dir), engine_process=False, dtype="float32", num_kv_blocks=256,
              defer_grammar_masks=defer, step_hooks=StepHooks(check_invariants=True),
              adaptive_threads=False)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [sp for _, sp in reqs],
                            use_tqdm=False)
        assert llm.engine.kv_manager.usage == 0.0          # every block given back
        return ([list(o.outputs[0].token_ids) for o in outs], [o.outputs[0] for o in outs],
                llm.engine.structured.stats())
    finally:
        llm.shutdown()


def test_engine_fills_a_mask_only_for_a_pick_without_an_allowed_candidate(tiny_model_dir):
    """A deferred request's mask is filled only on the steps where its pick and its
    candidates were refused, one fill each: never on the steps after (the tiny random
    model is refused often; budget-aware closing off, so nothing else narrows it)."""
    sp = SamplingParams(max_tokens=40, temperature=0,
                        structured_outputs=SO(json=SCHEMA, budget_aware=False))
    _, _, stats = _run(tiny_model_dir, True, [([1, 2, 3, 4], sp), ([5, 6], sp)])
    unrescued = stats.deferred_refused - stats.deferred_rescued
    assert unrescued > 0
    assert stats.fill_calls <= unrescued          # a step's refused rows share one fill


def test_engine_tokens_are_the_same_deferred_or_not(tiny_model_dir, tokenizer):
    """The tiny random model picks badly, so most deferred picks are refused and
    picked again: greedy outputs, a top-p request (it stays eager) and a free one
    are token for token the eager engine's; seeded temperature requests (one with
    penalties, a bias and min_tokens) are redrawn where refused, so they are the
    same on a second deferred run, not the eager tokens; every finished output
    is in its grammar."""
    mk = lambda **kw: SamplingParams(max_tokens=40, **kw)          # noqa: E731
    tok = lambda text: tokenizer.encode(text, add_special_tokens=False)[0]   # noqa: E731
    reqs = [([1, 2, 3, 4], mk(temperature=0, structured_outputs=SO(json=SCHEMA))),
            ([5, 6, 7], mk(temperature=0.9, seed=4, structured_outputs=SO(json=SCHEMA))),
            ([8, 9], mk(temperature=1.2, seed=9, structured_outputs=SO(regex=r"[a-z]{3,9}-[0-9]{2}"))),
            ([10, 11, 12], mk(temperature=0.2, top_p=0.9, seed=1, structured_outputs=SO(json=SCHEMA))),
            ([13, 14], mk(temperature=0, structured_outputs=SO(choice=["yes", "no", "maybe"]))),
            # penalties, a bias and min_tokens' bans commute with the mask too
            ([18, 19, 20], mk(temperature=0.9, seed=5, repetition_penalty=1.3, frequency_penalty=0.5,
                              logit_bias={7: 3.0, 9: -100}, min_tokens=3,
                              structured_outputs=SO(json=SCHEMA))),
            # the sampled ones compared token for token below (top-p, free) at low
            # temperatures: at 0.7 the random model's distribution is near-flat, so an
            # inverse-CDF draw lands on a neighbouring token id when a sum's rounding
            # moves (a fresh clone drew 33907 for 33906 deferred vs eager)
            ([15, 16, 17], mk(temperature=0.2, seed=2)),
            # greedy, biased so that a refused pick's next best tokens hold allowed ones
            # ('x' first; '"' and '{' next): re-picked from its candidates, no mask
            ([21, 22], mk(temperature=0, logit_bias={tok("x"): 100, tok('"'): 60, tok("{"): 60},
                          structured_outputs=SO(json=SCHEMA)))]
    on_ids, on_outs, on_stats = _run(tiny_model_dir, True, reqs)
    off_ids, off_outs, off_stats = _run(tiny_model_dir, False, reqs)
    again_ids, _, _ = _run(tiny_model_dir, True, reqs)
    # greedy, top-p (never deferred) and free requests are compared in a batch of their
    # own: in the mixed batch the redrawn requests end on other steps deferred or not,
    # so the batch's size differs, a row's logits move by float noise, and the random
    # model's near-flat distribution turns that into other draws (seen on another CPU)
    eager_equal = [reqs[i] for i in (0, 3, 4, 6, 7)]
    alone_on, _, alone_stats = _run(tiny_model_dir, True, eager_equal)
    alone_off, _, _ = _run(tiny_model_dir, False, eager_equal)
    assert alone_on == alone_off
    assert alone_stats.deferred_refused > 0     # (the greedy ones were refused and re-picked)
    assert again_ids == on_ids                  # seeded redraws are reproducible
    assert on_ids != off_ids                    # (the sampled ones did take the redraw path)
    for out in (on_outs[2], off_outs[2]):
        assert out.finish_reason != "stop" or re.fullmatch(r"[a-z]{3,9}-[0-9]{2}", out.text)
    assert on_stats.deferred_checks > 10 and on_stats.deferred_refused > 0
    assert 0 < on_stats.deferred_rescued < on_stats.deferred_refused   # both re-pick paths ran
    assert off_stats.deferred_checks == 0
    finished = 0
    for (_, sp), out in zip(reqs, on_outs):
        so = sp.structured_outputs
        if so is not None and so.json is not None and out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMA)
            finished += 1
        if so is not None and so.choice is not None:
            assert out.text in so.choice
