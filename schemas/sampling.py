"""Per-request sampling parameters (crosses the process boundary)."""
from __future__ import annotations

import math
from typing import Any

import msgspec

from formwork.schemas.errors import ParamError
from formwork.schemas.structured import StructuredOutputsParams

# vLLM's older name of StructuredOutputsParams (`from vllm.sampling_params import
# GuidedDecodingParams`, SamplingParams(guided_decoding=...)): the same class
GuidedDecodingParams = StructuredOutputsParams

_GREEDY_EPS = 1e-5
MAX_N = 128                  # completions per request: fan-out stays bounded (OpenAI: 128)
MAX_SEED = 2**63 - 1         # seeds travel as int64; seed + i for the i-th of n
MIN_SEED = -(2**63)          # negative seeds too, as vLLM takes them (any int64)
MAX_TOKEN_ID = 2**31         # any id past it is no vocabulary's (the engine checks its own)
MAX_PRIORITY = 2**31         # |priority| at most this: it travels as an int64
MAX_LOGIT_BIAS = 100.0       # OpenAI: biases in [-100, 100]; -100 bans the token
MAX_BAD_WORDS = 256          # bad_words per request (each tokenized twice at the gateway)
MAX_BAD_WORD_CHARS = 256
MAX_BEAM_WIDTH = 10          # a beam search round asks for 2 x width logprobs, at most 20


def check_token_ids(params: "SamplingParams", vocab_size: int) -> None:
    """ValueError naming the parameter for a token id outside the vocabulary
    (an id reaching a tensor index would fail the whole batch's step)."""
    words = [t for seq in params.bad_words_token_ids or () for t in seq]
    for name, ids in (("stop_token_ids", params.stop_token_ids or ()),
                      ("logit_bias", params.logit_bias or ()),
                      ("allowed_token_ids", params.allowed_token_ids or ()),
                      ("bad_words", words)):
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise ParamError(name, f"token id {bad} outside the vocabulary [0, {vocab_size})")


def resolve_bad_words(params: "SamplingParams", tokenizer) -> None:
    """Sets params.bad_words_token_ids from params.bad_words (as vLLM's
    update_from_tokenizer): each word (leading spaces dropped) as the tokenizer
    writes it alone and after a space, without special tokens; duplicates once."""
    if not params.bad_words:
        params.bad_words_token_ids = None
        return
    seqs: list[list[int]] = []
    for word in params.bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in seqs:
                seqs.append(ids)
    params.bad_words_token_ids = seqs


def with_stop_ids(params: "SamplingParams", extra: tuple[int, ...]) -> "SamplingParams":
    """`params` with the generation config's extra end ids among its stop_token_ids
    (unless it ignores the end; as vLLM's update_from_generation_config)."""
    if not extra or params.ignore_eos:
        return params
    mine = list(params.stop_token_ids or [])
    more = [t for t in extra if t not in mine]
    return params.clone(stop_token_ids=mine + more) if more else params


def check_beam_width(width: int, param: str = "beam_width") -> None:
    if not 1 <= width <= MAX_BEAM_WIDTH:
        raise ParamError(param, f"beam search takes a width in [1, {MAX_BEAM_WIDTH}] (its "
                         f"rounds ask for 2 x width logprobs, at most 20), got {width}")


def check_priority(params: "SamplingParams", scheduling_policy: str) -> None:
    """ValueError for a priority the engine's scheduling policy would ignore (as vLLM)."""
    if params.priority and scheduling_policy != "priority":
        raise ParamError("priority", "must be 0: requests are served first come, first served "
                         "(scheduling_policy 'priority', `--scheduling-policy priority`, serves "
                         "them by priority)")


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Like vLLM's SamplingParams. `temperature=0` means greedy.

    top_k: 0 or -1 disables; top_p in (0, 1]; min_p in [0, 1].
    logprobs: None, or how many top logprobs to return beside the chosen token's.
    prompt_logprobs: None, or how many top logprobs to return at each prompt
    position beside the prompt token's own (as vLLM). With it, max_tokens may be 0:
    the prompt is scored and nothing is generated.
    stop: strings that end generation (checked on the detokenized text, excluded
    from the output unless include_stop_str_in_output; under a structured-output
    constraint too, as vLLM: `stop_reason` then names the string).
    logit_bias: OpenAI's {token id: bias in [-100, 100]}, added to the logits
    before the grammar mask and sampling; -100 bans the token.
    allowed_token_ids: only these tokens may be sampled (as vLLM; the end-of-sequence
    token too only when listed).
    bad_words: words that must not be generated (as vLLM): each word is tokenized
    alone and after a space (`resolve_bad_words`, at the gateway, fills
    bad_words_token_ids); the last token of such a sequence is banned whenever the
    output so far ends with the rest of it.
    Where a grammar constrains the output and these restrictions (or logit_bias
    bans) leave a step no token the grammar allows, the grammar wins for that
    step: the output still follows it. Sampled tokens only: a grammar's forced
    continuation (jump-forward) is not taken for a request with such restrictions,
    so that its tokens are sampled under them.
    truncate_prompt_tokens: keep only the prompt's last k tokens (-1: the context
    length), as vLLM; applied by the offline LLM (the server's request field is its own).
    vLLM's other fields, so that its scripts run: `guided_decoding` is the older name
    of structured_outputs (GuidedDecodingParams, this module's alias of
    StructuredOutputsParams); `detokenize=False` leaves the outputs' text empty (token
    ids only; the text is still decoded internally, stop strings need it);
    `spaces_between_special_tokens` changes nothing with a fast tokenizer (the
    default model's); `extra_args` is taken for plugins (none read it); `output_kind`
    is the offline LLM's final output always; `logits_processors` are refused.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # bad_words as token sequences: set by the gateway from its tokenizer
    # (`formwork.gateway.params.resolve_bad_words`), read by the engine
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's per-request `priority` (an argument beside the params there), carried here so
    # that it travels with the request: under scheduling_policy "priority" a lower value is
    # served earlier; any other value than 0 is refused under "fcfs"
    priority: int = 0
    # vLLM's `cache_salt` (a field of the prompt there, of the request on its server),
    # carried here for the same reason: requests share prefix-cache blocks only with
    # requests of the same salt (None: with every unsalted request)
    cache_salt: str | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    # vLLM's fields taken for its scripts' sake (see the docstring); guided_decoding is
    # folded into structured_outputs at construction and reads None afterwards
    guided_decoding: StructuredOutputsParams | None = None
    spaces_between_special_tokens: bool = True
    extra_args: dict[str, Any] | None = None
    output_kind: int | None = None
    logits_processors: list[Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ParamError("guided_decoding", "the older name of structured_outputs: "
                                                    "give one of them")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def restricts_tokens(self) -> bool:
        """Whether some tokens are banned outright (allowed_token_ids, bad_words,
        a logit_bias of -100): such a request samples every token under its mask."""
        return bool(self.allowed_token_ids or self.bad_words_token_ids or (
            self.logit_bias and any(v <= -MAX_LOGIT_BIAS for v in self.logit_bias.values())))

    def validate(self) -> None:
        """Raise ValueError naming the offending parameter."""
        def bad(param: str, msg: str) -> None:
            raise ParamError(param, msg)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                bad(name, f"must be a finite number, got {getattr(self, name)}")
        if not 1 <= self.n <= MAX_N:
            bad("n", f"must be in [1, {MAX_N}], got {self.n}")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED - self.n:
            bad("seed", f"must be in [-2^63, 2^63 - n], got {self.seed}")
        if self.cache_salt is not None and not self.cache_salt:
            bad("cache_salt", "must be a non-empty string (leave it out for no salt)")
        if not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            bad("priority", f"must be in [-2^31, 2^31], got {self.priority}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        min_max_tokens = 0 if self.prompt_logprobs is not None else 1
        if self.max_tokens is not None and self.max_tokens < min_max_tokens:
            bad("max_tokens", f"must be >= {min_max_tokens} (0 only with prompt_logprobs), "
                f"got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        if self.stop is not None and any((not isinstance(s, str)) or s == "" for s in self.stop):
            bad("stop", "must be non-empty strings")
        if self.stop_token_ids is not None and \
                any(not 0 <= t < MAX_TOKEN_ID for t in self.stop_token_ids):
            bad("stop_token_ids", f"must be token ids in [0, {MAX_TOKEN_ID})")
        if self.logit_bias is not None:
            for t, v in self.logit_bias.items():
                if not 0 <= t < MAX_TOKEN_ID:
                    bad("logit_bias", f"keys must be token ids in [0, {MAX_TOKEN_ID}), got {t}")
                if not (math.isfinite(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS):
                    bad("logit_bias", f"biases must be in [-100, 100], got {v} for token {t}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids", "must list at least one token id (leave it out to "
                    "allow every token)")
            if any(not 0 <= t < MAX_TOKEN_ID for t in self.allowed_token_ids):
                bad("allowed_token_ids", f"must be token ids in [0, {MAX_TOKEN_ID})")
            bans = {t for t, v in (self.logit_bias or {}).items() if v <= -MAX_LOGIT_BIAS}
            if bans.issuperset(self.allowed_token_ids):
                bad("allowed_token_ids", "logit_bias bans every token allowed_token_ids allows")
        if self.bad_words is not None:
            if len(self.bad_words) > MAX_BAD_WORDS:
                bad("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
            for w in self.bad_words:
                if not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS:
                    bad("bad_words", f"must be words of 1 to {MAX_BAD_WORD_CHARS} characters "
                        f"(not only spaces), got {w!r}")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()
        if self.logits_processors:
            bad("logits_processors", "custom logits processors are not served")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            bad("truncate_prompt_tokens", f"must be -1 (the context length) or at least 1, "
                f"got {self.truncate_prompt_tokens}")
        if self.truncate_prompt_tokens == 0:
            bad("truncate_prompt_tokens", "must be -1 (the context length) or at least 1, got 0")
        if not self.detokenize and self.stop:
            bad("detokenize", "stop strings are matched on the text: detokenize=False cannot "
                              "go with them (stop_token_ids can)")

    def clone(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)


class BeamSearchParams(msgspec.Struct, kw_only=True):
    """vLLM's BeamSearchParams for `LLM.beam_search` (gateway/beam_search.py):
    `beam_width` beams (at most 10), `max_tokens` rounds; `temperature` applies to
    the one-token requests of each round (their candidates are the raw logprobs'
    top 2 x width, as vLLM's); `length_penalty` divides the cumulative logprob by
    length ** length_penalty when ranking; `ignore_eos` keeps beams growing past
    the end token."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        check_beam_width(self.beam_width)
        if self.max_tokens < 1:
            raise ParamError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        for name in ("temperature", "length_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ParamError(name, f"must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ParamError("temperature", f"must be >= 0, got {self.temperature}")
