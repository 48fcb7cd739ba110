"""StructuredOutputManager: compiles constraints off the engine thread and owns
every request's matcher state.

Threading contract: all public methods are called from the engine thread;
compilation runs in a private thread pool. The compile cache and the table of
in-flight compiles are shared with the pool under `_lock`; matchers are
touched only by the engine thread.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from formwork.grammar.backend import CompiledGrammar, GrammarBackend, Matcher, allocate_bitmask
from formwork.grammar import budget as budget_policy
from formwork.grammar.budget import Budget
from formwork.grammar.closing_search import ClosingSearch
from formwork.grammar.compile_pool import compile_pool
from formwork.grammar.jump_forward import ForcedTextEncoder, forced_tokens
from formwork.grammar.llguidance_backend import LLGuidanceBackend
from formwork.grammar.outlines_backend import OutlinesBackend
from formwork.grammar.reasoning_matcher import ThinkFirstMatcher, thinking_mask
from formwork.grammar.selection import choose_backend
from formwork.grammar.vocab import TokenVocab
from formwork.grammar.xgrammar_backend import XGrammarBackend
from formwork.schemas.errors import ParamError
from formwork.schemas.structured import (GrammarStats, GrammarStatus, StructuredOutputsParams,
                                         reasoning_end_id)

# Constraint kinds budget-aware decoding applies to unless a request says otherwise.
BUDGET_DEFAULT_KINDS = ("json", "json_object", "structural_tag")


@dataclass(slots=True)
class _RequestGrammar:
    future: Future | None
    submitted_at: float
    status: GrammarStatus = "pending"
    error: str = ""
    matcher: Matcher | None = None
    backend: GrammarBackend | None = None
    budget: Budget | None = None  # None: not budget-aware
    # reasoning_end: (the tag's token id, the thinking mask) when the constraint
    # applies after the model's thinking (grammar/reasoning_matcher.py)
    think: tuple[int, torch.Tensor] | None = None


def build_backend(name: str, vocab: TokenVocab, tokenizer, *, num_threads: int = 2,
                  compile_timeout_s: float = 30.0) -> GrammarBackend:
    """The backend called `name` (as grammar.selection names them) for this vocabulary."""
    if name == "llguidance":
        return LLGuidanceBackend(vocab, tokenizer, max_threads=num_threads)
    if name == "xgrammar":
        return XGrammarBackend(vocab, max_threads=num_threads)
    assert name == "outlines", name
    return OutlinesBackend(vocab, compile_timeout_s=compile_timeout_s)


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, *, default_backend: str = "auto",
                 num_threads: int = 2, compile_timeout_s: float = 30.0,
                 enable_jump_forward: bool = True, cache_size: int = 256,
                 budget_aware: bool = True):
        self._tokenizer = tokenizer
        self.vocab = TokenVocab.from_tokenizer(tokenizer, vocab_size)
        self.vocab_size = vocab_size
        self._default_backend = default_backend
        self._timeout_s = compile_timeout_s
        self._jump_forward = enable_jump_forward
        self._cache_size = cache_size
        self._num_threads = num_threads
        # auto's usual picks are built up front (~0.3 s); outlines-core's vocabulary
        # only when a constraint first needs it.
        self._backends: dict[str, GrammarBackend] = {
            name: self._new_backend(name) for name in ("llguidance", "xgrammar")}
        self._pool = compile_pool(num_threads)     # threads at a lower CPU priority
        self._lock = threading.Lock()   # guards _cache, _inflight, _stats
        self._backend_lock = threading.Lock()   # guards _backends
        self._cache: OrderedDict[str, tuple[CompiledGrammar, GrammarBackend]] = OrderedDict()
        self._inflight: dict[str, Future] = {}
        self._stats = GrammarStats()
        self._requests: dict[str, _RequestGrammar] = {}
        self._bitmask = allocate_bitmask(8, vocab_size)   # [rows, words], grown on demand
        self._budget_aware = budget_aware     # default for JSON-schema requests
        self._forced = ForcedTextEncoder(tokenizer, self.vocab)   # engine thread only
        self._closing = ClosingSearch(self.vocab, vocab_size, self.vocab.eos_token_id,
                                      self._forced)
        self._thinking: dict[str, tuple[int, torch.Tensor] | None] = {}   # by tag

    # --- compilation ---------------------------------------------------------------
    def submit(self, request_id: str, params: StructuredOutputsParams,
               budget: int | None = None) -> None:
        """Start compiling `params` for `request_id`; never blocks on compilation.
        `budget`: the most tokens the request may generate (max_tokens, context room);
        with budget-aware decoding on, its output is closed before they run out."""
        assert request_id not in self._requests, f"duplicate request id {request_id!r}"
        entry = _RequestGrammar(future=None, submitted_at=time.monotonic())
        self._requests[request_id] = entry
        try:
            key = params.cache_key()
            if params.reasoning_end is not None:
                entry.think = self._think(params.reasoning_end)
            elif budget is not None and self._budget_on(params):
                entry.budget = Budget(budget, key)   # (a thinking request is never closed early)
        except ValueError as err:
            entry.status, entry.error = "failed", str(err)
            return
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self._stats.cache_hits += 1
                compiled, backend = self._cache[key]
                self._set_ready(entry, compiled, backend)
                return
            future, is_new = self._inflight.get(key), False
            if future is not None:
                self._stats.inflight_shared += 1
            else:
                future = self._pool.submit(self._compile, params)
                self._inflight[key] = future
                is_new = True
        if is_new:   # outside the lock: a finished future runs the callback right here
            future.add_done_callback(lambda f, key=key: self._on_compiled(key, f))
        entry.future = future

    def _think(self, tag: str) -> tuple[int, torch.Tensor]:
        """The tag's token id and the thinking mask (built once per tag)."""
        if tag not in self._thinking:
            end = reasoning_end_id(self._tokenizer, tag)
            self._thinking[tag] = (None if end is None or end >= self.vocab_size else
                                   (end, thinking_mask(self.vocab, self._tokenizer, end)))
        found = self._thinking[tag]
        if found is None:
            raise ParamError("structured_outputs.reasoning_end",
                             f"{tag!r} is not one token of this model's vocabulary")
        return found

    def _budget_on(self, params: StructuredOutputsParams) -> bool:
        """Per request `budget_aware`, else the server's default for JSON: schemas,
        `json_object`, and structural tags (tool calls under tool_choice "auto", an
        answer's schema beside tools: a call or an answer cut at max_tokens is text
        no client can parse). Regex, choice and grammar outputs are the caller's own
        language, where an early end may not be what they want."""
        if params.budget_aware is not None:
            return params.budget_aware
        return self._budget_aware and params.kind() in BUDGET_DEFAULT_KINDS

    def budget_closed(self, request_id: str) -> bool:
        """Whether budget-aware decoding narrowed this request's output to close it
        (its end was then forced by max_tokens: the finish reason says "length")."""
        entry = self._requests.get(request_id)
        return entry is not None and entry.budget is not None and entry.budget.closed_early

    def budget_guard(self, request_id: str, token_id: int) -> int | None:
        """Budget-aware decoding, before a sampled token is committed: the token to
        commit instead when `token_id` would leave no closing path in the tokens
        left (grammar/budget.guard); None to keep it."""
        entry = self._requests.get(request_id)
        if entry is None or entry.budget is None or entry.status != "ready":
            return None
        return budget_policy.guard(self._closing, entry.budget, entry.matcher, token_id)

    def _spend(self, request_id: str, token_ids: list[int]) -> None:
        if (budget := self._requests[request_id].budget) is not None:
            budget.spend(token_ids)

    def _backend(self, name: str) -> GrammarBackend:
        with self._backend_lock:
            if name not in self._backends:   # each vocabulary is built on first use
                self._backends[name] = self._new_backend(name)
            return self._backends[name]

    def _new_backend(self, name: str) -> GrammarBackend:
        return build_backend(name, self.vocab, self._tokenizer, num_threads=self._num_threads,
                             compile_timeout_s=self._timeout_s)

    def _compile(self, params: StructuredOutputsParams
                 ) -> tuple[CompiledGrammar, GrammarBackend, float]:
        """Pool thread: choose a backend, compile; (compiled, backend, seconds)."""
        start = time.perf_counter()
        backend = self._backend(choose_backend(params, self._default_backend))
        compiled = backend.compile(params)
        return compiled, backend, time.perf_counter() - start

    def _on_compiled(self, key: str, future: Future) -> None:
        with self._lock:
            self._inflight.pop(key, None)
            if future.exception() is not None:
                self._stats.compile_failures += 1
                return
            compiled, backend, seconds = future.result()
            self._stats.compiles += 1
            self._stats.compile_seconds += seconds
            self._stats.by_backend[backend.name] = self._stats.by_backend.get(backend.name, 0) + 1
            self._cache[key] = (compiled, backend)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def _set_ready(self, entry: _RequestGrammar, compiled: CompiledGrammar,
                   backend: GrammarBackend) -> None:
        matcher = compiled.new_matcher()
        if entry.think is not None:
            matcher = ThinkFirstMatcher(matcher, *entry.think)
        entry.status, entry.backend, entry.matcher = "ready", backend, matcher

    def status(self, request_id: str) -> GrammarStatus:
        """"pending" until compiled; "failed" on error or after compile_timeout_s."""
        entry = self._requests[request_id]
        if entry.status != "pending":
            return entry.status
        assert entry.future is not None
        if entry.future.done():
            err = entry.future.exception()
            if err is None:
                compiled, backend, _ = entry.future.result()
                self._set_ready(entry, compiled, backend)
            else:
                entry.status = "failed"
                entry.error = str(err) if isinstance(err, ValueError) else \
                    f"grammar compilation failed: {type(err).__name__}: {err}"
        elif time.monotonic() - entry.submitted_at > self._timeout_s:
            entry.status = "failed"
            entry.error = (f"grammar compilation took longer than {self._timeout_s:g} s; "
                           "simplify the constraint (fewer alternatives, bounded lengths)")
        return entry.status

    def error(self, request_id: str) -> str:
        return self._requests[request_id].error

    def remove(self, request_id: str) -> None:
        """Forget the request (its compile, if running, still fills the cache)."""
        self._requests.pop(request_id, None)

    # --- matching (engine thread) ---------------------------------------------------
    def _matcher(self, request_id: str) -> Matcher:
        entry = self._requests[request_id]
        if entry.status != "ready":
            raise RuntimeError(f"request {request_id!r} grammar is {entry.status}, not ready")
        assert entry.matcher is not None
        return entry.matcher

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance the matcher; False (state unchanged) if a token is not allowed, or
        if the matcher failed (a backend resource limit): error() then says why."""
        matcher = self._matcher(request_id)
        if matcher.accept_tokens(token_ids):
            self._spend(request_id, list(token_ids))
            return True
        if reason := getattr(matcher, "error", ""):
            self._requests[request_id].error = f"grammar matcher failed: {reason.splitlines()[0]}"
        elif not matcher.is_terminated() and not self._allows_any(matcher):
            self._requests[request_id].error = (
                "the constraint admits no token here: no text continues it (its language is "
                "empty from this point, e.g. a regex of UTF-16 surrogates, which no UTF-8 "
                "text holds)")
        return False

    def _allows_any(self, matcher: Matcher) -> bool:
        """Whether the matcher's mask allows some token (asked only after a refusal)."""
        row = allocate_bitmask(1, self.vocab_size)
        matcher.fill_bitmask(row, 0)
        return bool(row.any())

    def is_terminated(self, request_id: str) -> bool:
        return self._matcher(request_id).is_terminated()

    def jump_forward_tokens(self, request_id: str) -> list[int]:
        """Tokens of the forced continuation, already accepted; [] if none/disabled."""
        if not self._jump_forward:
            return []
        tokens = forced_tokens(self._matcher(request_id), self._forced)
        self._spend(request_id, tokens)
        self._stats.jump_forward_tokens += len(tokens)
        return tokens

    def fill_bitmask(self, request_ids: list[str]) -> torch.Tensor | None:
        """int32 `[len(request_ids), ceil(vocab/32)]`, row i for request_ids[i]; ids
        without a constraint get all-allowed rows; None if no id is constrained.
        Returns a view of a reused buffer: valid until the next call."""
        start = time.perf_counter()
        n = len(request_ids)
        if n > self._bitmask.shape[0]:
            self._bitmask = allocate_bitmask(max(n, 2 * self._bitmask.shape[0]), self.vocab_size)
        out = self._bitmask[:n]
        groups: dict[str, tuple[GrammarBackend, list[Matcher], list[int]]] = {}
        filled = False   # a row written here, not by a backend
        for row, rid in enumerate(request_ids):
            if rid not in self._requests:
                out[row].fill_(-1)
                continue
            entry, matcher = self._requests[rid], self._matcher(rid)
            if entry.budget is not None and \
                    budget_policy.steer(self._closing, entry.budget, matcher, out, row):
                self._stats.budget_steered_steps += 1   # narrowed to one token: no fill
                filled = True
                continue
            if isinstance(matcher, ThinkFirstMatcher):
                if matcher.thinking:          # the thinking mask: no backend fill
                    matcher.fill_bitmask(out, row)
                    filled = True
                    continue
                matcher = matcher.inner
            backend = entry.backend
            assert backend is not None
            group = groups.setdefault(backend.name, (backend, [], []))
            group[1].append(matcher)
            group[2].append(row)
        for backend, matchers, rows in groups.values():
            backend.fill_bitmasks(matchers, out, rows)
        self._stats.fill_calls += 1
        self._stats.fill_seconds += time.perf_counter() - start
        return out if groups or filled else None

    # --- deferred masks (engine thread; EngineCore's step, gpu/sampler.py) -----------
    def can_defer(self, request_id: str) -> bool:
        """Whether this step may sample the request without its mask and check the
        pick after: its matcher is ready and running and budget-aware steering cannot
        narrow its mask this step. Call once per step per request.

        A request whose pick was refused is deferred again at once (no eager steps
        after a refusal: they used to follow for 2-32 steps). Measured on
        bench/structured_shapes.py's shapes at batch 32 (fill + rescue + redraw per
        step, engine thread): greedy, nested 0.86 -> 0.40 ms, Kubernetes 0.97 -> 0.37,
        bounded string 0.56 -> 0.16, pattern 0.47 -> 0.31; at temperature 0.7 nested
        2.9 -> 1.4, Kubernetes 2.4 -> 1.4, pattern 1.6 -> 1.2. With the rescue
        candidates most refusals need no mask, and the steps after one mostly pick an
        allowed token (greedy nested: 25 redraws with eager steps, 26 without, where
        the eager steps filled ~270 masks)."""
        entry = self._requests.get(request_id)
        return not (entry is None or entry.status != "ready" or entry.matcher.is_terminated() or
                    (entry.budget is not None and
                     budget_policy.forced_next(self._closing, entry.budget, entry.matcher) is not None))

    def check_deferred(self, request_id: str, token_id: int) -> bool:
        """Whether the grammar allows `token_id` next (matcher unchanged); counted."""
        ok = self._matcher(request_id).accepts(token_id)
        self._stats.deferred_checks += 1
        if not ok:
            self._stats.deferred_refused += 1
        return ok

    def first_allowed(self, request_id: str, token_ids: list[int]) -> int | None:
        """The first of `token_ids` the grammar allows next (matcher unchanged), or None.
        With a row's candidates (gpu/sampler.Sampler.candidates) it is an exact masked
        pick, found in a few checks instead of a mask fill and a second pick."""
        matcher = self._matcher(request_id)
        for t in token_ids:
            if matcher.accepts(t):
                self._stats.deferred_rescued += 1
                return t
        return None

    def stats(self) -> GrammarStats:
        with self._lock:
            return replace(self._stats, by_backend=dict(self._stats.by_backend),
                           cache_size=len(self._cache))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
