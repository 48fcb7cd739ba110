"""Turns EngineCoreOutputs into user-facing RequestOutputs: incremental
detokenization, stop strings, n > 1 fan-in, logprobs. Owns the client-side
view of each request (one writer: the gateway's output loop, or the offline LLM).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

from formwork.schemas.engine import (EngineCoreOutput, EngineCoreRequest, FinishReason, PromptLogprobs,
                            TokenLogprobs)
from formwork.schemas.sampling import SamplingParams


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # the engine's entries while in flight (the server reads them); a finished output of
    # the offline LLM carries vLLM's shape instead (SampleLogprobs, see LLM._run)
    logprobs: list[TokenLogprobs] | SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    error: str | None = None
    error_param: str | None = None
    # since the previous RequestOutput of this request (for streaming)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def lora_request(self) -> None:
        """vLLM's: the adapter that produced it; none is served."""
        return None


@dataclass(slots=True)
class Logprob:
    """One token's entry in a logprobs or prompt_logprobs dict (vLLM's shape)."""
    logprob: float
    rank: int | None = None           # 1-based rank in the vocabulary
    decoded_token: str | None = None


# per prompt position: None for the first token, then {token_id: Logprob} holding the
# prompt token itself and the top-k (a token in both appears once)
PromptLogprobsList = list[dict[int, Logprob] | None]
# per generated position (vLLM's SampleLogprobs): {token_id: Logprob}, the sampled token
# first, then the top-n (a token in both appears once)
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobsList | None = None

    # vLLM's fields a script may read, None here: no per-request metrics are kept (the
    # server's histograms have the timings), no adapter, no encoder prompt
    @property
    def metrics(self) -> None:
        return None

    @property
    def lora_request(self) -> None:
        return None

    @property
    def encoder_prompt(self) -> None:
        return None

    @property
    def encoder_prompt_token_ids(self) -> None:
        return None

    @property
    def kv_transfer_params(self) -> None:
        return None


class _Detok:
    """Incremental detokenizer + stop strings for one completion.

    Text that could still turn out to be the start of a stop string is held
    back from the deltas until it is disambiguated.
    """

    def __init__(self, tokenizer, params: SamplingParams):
        self._tok = tokenizer._tokenizer if hasattr(tokenizer, "_tokenizer") else tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._skip_special = params.skip_special_tokens
        self.ids: list[int] = []  # tokens added (for the flush at the end)
        self._held = False        # the last step gave no text: the stream may hold some
        # Stop strings apply under a structured-output constraint too, as vLLM's: the
        # client asked for the cut. `stop_reason` names the string, so a cut output is
        # told apart from one the grammar ended (stop_reason None).
        self.stops = params.stop or []
        self.include_stop = params.include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        # as vLLM's: stop strings are looked for once more than min_tokens are out
        self.min_tokens = params.min_tokens
        self.count = 0            # tokens added
        self.text = ""
        self.emitted = 0          # chars of self.text already sent as deltas

    def add(self, token_id: int) -> str | None:
        """Appends one token's text; returns the stop string hit, if any."""
        self.count += 1
        self.ids.append(token_id)
        piece = self._stream.step(self._tok, token_id)
        self._held = not piece
        return self._append(piece)

    def flush(self) -> str | None:
        """At the end of the output: the text the stream still holds back. DecodeStream
        waits while the text ends in U+FFFD (a character whose bytes may be unfinished),
        so an output ending in a real U+FFFD (a `choice` of "ok\ufffd") lost it, and
        one cut mid-character lost its last token's text (a space with it). The whole
        output decoded says what is left (decoded only where the last step gave no
        text: a step that does gives all it held); returns the stop string hit, if any."""
        if not self._held:
            return None
        whole = self._tok.decode(self.ids, skip_special_tokens=self._skip_special)
        if len(whole) <= len(self.text) or not whole.startswith(self.text):
            return None
        return self._append(whole[len(self.text):])

    def _append(self, piece: str | None) -> str | None:
        if not piece:
            return None
        if self.count <= self.min_tokens:
            self.text += piece
            return None
        before = len(self.text)
        self.text += piece
        # the earliest stop string in the text, not the first of the list found anywhere:
        # with stop ["a", "e"] a token " Armenia" was cut to " Armeni" (vLLM cuts so
        # too), a text that holds a stop string; at one position, the list's first wins.
        # Only a string that ends in the new piece counts (as vLLM's window): one that
        # ended in the text of the first min_tokens tokens was passed over there, and
        # finding it now cut the output back inside those tokens
        hits = [(i, k) for k, s in enumerate(self.stops)
                if (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
        if not hits:
            return None
        i, k = min(hits)
        s = self.stops[k]
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        return s

    def take_delta(self, finished: bool) -> str:
        end = len(self.text) if finished or not self.stops else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta


@dataclass(slots=True)
class _Child:
    parent: "_Parent"
    index: int
    params: SamplingParams
    detok: _Detok
    out: CompletionOutput
    eos: int | None = None


@dataclass(slots=True)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobsList | None = None


def child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, _Child] = {}
        self._token_text: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._parents)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float = 0.0,
                    eos_token_id: int | None = None) -> list[EngineCoreRequest]:
        """Registers a request; returns the engine requests to send (n of them)."""
        if request_id in self._parents:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        eos = eos_token_id if eos_token_id is not None else self.tokenizer.eos_token_id
        parent = _Parent(request_id, prompt, list(prompt_token_ids))
        engine_reqs = []
        for i in range(params.n):
            cp = params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            cid = child_id(request_id, i, params.n)
            child = _Child(parent, i, cp, _Detok(self.tokenizer, cp), CompletionOutput(index=i), eos)
            if cp.logprobs is not None:
                child.out.logprobs, child.out.cumulative_logprob = [], 0.0
            parent.children.append(child)
            self._children[cid] = child
            engine_reqs.append(EngineCoreRequest(request_id=cid, prompt_token_ids=list(prompt_token_ids),
                                                 sampling_params=cp, eos_token_id=eos,
                                                 arrival_time=arrival_time))
        self._parents[request_id] = parent
        return engine_reqs

    def abort_request(self, request_id: str) -> list[str]:
        """Forgets a request; returns the engine ids still to abort."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        ids = [child_id(request_id, c.index, len(parent.children)) for c in parent.children]
        for cid, c in zip(ids, parent.children):
            self._children.pop(cid, None)
        return [cid for cid, c in zip(ids, parent.children) if not c.out.finished]

    def _apply(self, child: _Child, eo: EngineCoreOutput) -> bool:
        """Applies one engine output to a child; returns True if a stop string ended it."""
        out = child.out
        stop_hit = None
        # The token that ended the output (the end token, or one of stop_token_ids) is
        # kept in token_ids but not written into the text unless
        # include_stop_str_in_output, as vLLM does: with skip_special_tokens=False a
        # JSON output was followed by `<|im_end|>`, and a stop token's own text stayed.
        ender = len(eo.new_token_ids) - 1 if self._ended_by_token(child, eo) else -1
        for k, tid in enumerate(eo.new_token_ids):
            out.token_ids.append(tid)
            out.delta_token_ids.append(tid)
            if eo.new_logprobs is not None and out.logprobs is not None and k < len(eo.new_logprobs):
                lp = eo.new_logprobs[k]
                out.logprobs.append(lp)
                out.delta_logprobs = (out.delta_logprobs or []) + [lp]
                out.cumulative_logprob += lp.chosen.logprob
            if k == ender:
                break
            stop_hit = child.detok.add(tid)
            if stop_hit is not None:
                break
        if stop_hit is None and eo.finish_reason is not None:
            stop_hit = child.detok.flush()
        if stop_hit is not None:
            out.finish_reason, out.stop_reason = FinishReason.STOP.value, stop_hit
        elif eo.finish_reason is not None:
            out.finish_reason, out.stop_reason = eo.finish_reason.value, eo.stop_reason
            out.error, out.error_param = eo.error, eo.error_param
        child.parent.num_cached_tokens = max(child.parent.num_cached_tokens, eo.num_cached_tokens)
        # every child scores the prompt (so each one's first output carries it); the first kept
        if eo.prompt_logprobs is not None and child.parent.prompt_logprobs is None:
            child.parent.prompt_logprobs = self._prompt_logprobs(eo.prompt_logprobs)
        return stop_hit is not None and eo.finish_reason is None

    @staticmethod
    def _ended_by_token(child: _Child, eo: EngineCoreOutput) -> bool:
        """Whether `eo` finished `child` on an end token or a stop token id (its last
        new token), whose text the output leaves out unless include_stop_str_in_output."""
        if eo.finish_reason != FinishReason.STOP or not eo.new_token_ids \
                or child.params.include_stop_str_in_output:
            return False
        last = eo.new_token_ids[-1]
        if isinstance(eo.stop_reason, int) and not isinstance(eo.stop_reason, bool):
            return last == eo.stop_reason
        # (under ignore_eos too: a grammar that has ended allows only the end token)
        return eo.stop_reason is None and last == child.eos

    def _text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False)
        return text

    def _position(self, token, rank: int | None, top) -> dict[int, Logprob]:
        """vLLM's {token_id: Logprob} of one position: `token` (the prompt token or the
        pick) first with its rank, then the top ones (ranks 1..k; a token in both once)."""
        d = {token.token_id: Logprob(token.logprob, rank, self._text(token.token_id))}
        for k, a in enumerate(top, 1):
            d.setdefault(a.token_id, Logprob(a.logprob, k, self._text(a.token_id)))
        return d

    def _prompt_logprobs(self, entries: list[PromptLogprobs]) -> PromptLogprobsList:
        return [None] + [self._position(e.token, e.rank, e.top) for e in entries]

    def sample_logprobs(self, entries: list[TokenLogprobs]) -> SampleLogprobs:
        """The offline API's logprobs (vLLM's shape) of a completion's engine entries."""
        return [self._position(e.chosen, e.rank, e.top) for e in entries]

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (request outputs with deltas, engine request ids to abort)."""
        touched: dict[str, _Parent] = {}
        to_abort: list[str] = []
        for eo in outputs:
            child = self._children.get(eo.request_id)
            if child is None or child.out.finished:
                continue                    # aborted by us, or late output after a stop string
            if self._apply(child, eo):
                to_abort.append(eo.request_id)
            touched[child.parent.request_id] = child.parent
        results = []
        for parent in touched.values():
            results.append(self._snapshot(parent))
        return results, to_abort

    def _snapshot(self, parent: _Parent) -> RequestOutput:
        outs = []
        for c in parent.children:
            o = c.out
            snap = CompletionOutput(
                index=o.index, text=c.detok.text, token_ids=list(o.token_ids),
                finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                logprobs=list(o.logprobs) if o.logprobs is not None else None,
                cumulative_logprob=o.cumulative_logprob, error=o.error,
                error_param=o.error_param,
                delta_text=c.detok.take_delta(o.finished), delta_token_ids=o.delta_token_ids,
                delta_logprobs=o.delta_logprobs)
            o.delta_token_ids, o.delta_logprobs = [], None
            outs.append(snap)
        finished = all(c.out.finished for c in parent.children)
        if finished:
            self.abort_request(parent.request_id)   # forget it
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outs,
                             finished, parent.num_cached_tokens, parent.prompt_logprobs)
