"""Messages between the gateway and the EngineCore (msgspec, msgpack on the wire).

Small and typed; never tensors. Two sockets:

    input  (gateway -> engine): InputMessage, a tagged union (field "type"):
           "add" EngineCoreRequest | "abort" EngineCoreAbort
           | "utility" EngineCoreUtility | "shutdown" EngineShutdown
    output (engine -> gateway): EngineCoreOutputs; a utility answer carries one
           UtilityResult, a tagged union of the per-method result structs
           (UTILITY_RESULTS) or UtilityError. The ready handshake is the answer
           to call id 0: EngineInfo, or UtilityError when the engine could not start.
"""
from __future__ import annotations

import enum
import time

import msgspec

from formwork.schemas.errors import ParamError, msgspec_refusal
from formwork.schemas.sampling import SamplingParams


class FinishReason(str, enum.Enum):
    STOP = "stop"        # eos / stop token / stop string / grammar terminated
    LENGTH = "length"    # max_tokens or the context length
    ABORT = "abort"      # cancelled by the client
    ERROR = "error"      # this request failed alone (e.g. grammar compile error)


class EngineCoreRequest(msgspec.Struct, omit_defaults=True, kw_only=True, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0


class EngineCoreAbort(msgspec.Struct, kw_only=True, tag="abort"):
    request_ids: list[str]


class EngineCoreUtility(msgspec.Struct, kw_only=True, tag="utility"):
    """A call of an engine method by name (a key of UTILITY_RESULTS: read-only but
    reset_prefix_cache), answered in EngineCoreOutputs.utility_result under the same
    call_id."""
    call_id: int
    method: str


class EngineShutdown(msgspec.Struct, tag="shutdown"):
    """The engine process finishes its loop and exits."""


InputMessage = EngineCoreRequest | EngineCoreAbort | EngineCoreUtility | EngineShutdown

_REQUEST_DECODER = msgspec.msgpack.Decoder(EngineCoreRequest)


def encode_input(encoder: msgspec.msgpack.Encoder, msg: InputMessage) -> bytes:
    """`msg` as the engine reads it. A request is decoded back first, as the engine
    will: msgspec checks types when it decodes, not when a struct is built, so a
    value of the wrong type set from Python (`structured_outputs.json = 5`, a float
    among the prompt's ids) would otherwise fail in the engine's decoder. Refused
    here instead, as a ParamError naming the field (~20 µs per 1,000 prompt tokens)."""
    data = encoder.encode(msg)
    if isinstance(msg, EngineCoreRequest):
        try:
            _REQUEST_DECODER.decode(data)
        except msgspec.ValidationError as e:
            err = msgspec_refusal(e, "request")
            param = err.param.removeprefix("request.").removeprefix("sampling_params.")
            raise ParamError("prompt" if param.startswith("prompt_token_ids") else param,
                             err.message) from None
    return data


class Logprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class TokenLogprobs(msgspec.Struct, array_like=True):
    """The chosen token's logprob and the top-n alternatives at one position, and
    the chosen token's 1-based rank in the distribution (None where not computed)."""
    chosen: Logprob
    top: list[Logprob]
    rank: int | None = None


class PromptLogprobs(msgspec.Struct, array_like=True):
    """One prompt token's logprob given the tokens before it, its 1-based rank in
    the vocabulary, and the top-k tokens at that position (best first)."""
    token: Logprob
    rank: int
    top: list[Logprob]


class EngineCoreOutput(msgspec.Struct, omit_defaults=True, kw_only=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    # once, with the first output after the prefill: prompt tokens 1.. (token 0 has none)
    prompt_logprobs: list[PromptLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    error_param: str | None = None   # the refused field (OpenAI's error.param), as data

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineStats(msgspec.Struct, kw_only=True, tag="stats"):
    """What `get_stats` answers: the scheduler's queues, the KV pool, the prefix
    cache, grammar work and the CPU thread team, as counts since start-up."""
    num_running: int
    num_waiting: int
    num_waiting_for_grammar: int
    kv_total_blocks: int
    kv_free_blocks: int
    kv_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    grammar_compiles: int = 0
    grammar_cache_hits: int = 0
    grammar_compile_seconds: float = 0.0
    bitmask_seconds: float = 0.0
    grammar_deferred_checks: int = 0     # picks made without the mask, then checked
    grammar_deferred_refused: int = 0    # ... refused by the grammar (picked again, masked)
    grammar_deferred_rescued: int = 0    # ... re-picked from the row's best tokens, no mask
    steps: int = 0
    forward_threads: int = 0        # CPU: the forward's thread team now (0: not governed)
    thread_resizes: int = 0         # times the team was resized to the free cores


class EngineInfo(msgspec.Struct, kw_only=True, frozen=True, tag="info"):
    """What the engine learned at start-up (the ready handshake, and `info`)."""
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    device: str
    dtype: str
    attention_backend: str
    cuda_graph_sizes: tuple[int, ...] = ()      # decode batch sizes replayed as graphs
    structured_backend: str
    load_seconds: float
    pid: int
    omp_wait_policy: str = ""
    gomp_spincount: str = ""


class Pong(msgspec.Struct, tag="pong"):
    """What `ping` answers: the engine loop is alive."""


class Reset(msgspec.Struct, kw_only=True, tag="reset"):
    """What `reset_prefix_cache` answers: whether the prefix cache was emptied (not
    while a request holds KV blocks)."""
    done: bool


class UtilityError(msgspec.Struct, kw_only=True, tag="error"):
    """A utility call that failed (unknown method, the method raised), or an
    engine that could not start (the handshake)."""
    message: str


UtilityResult = EngineInfo | EngineStats | Pong | Reset | UtilityError
# the engine methods a utility call may name (read-only but reset_prefix_cache, which
# only forgets cached blocks), and what each answers
UTILITY_RESULTS: dict[str, type] = {"ping": Pong, "get_stats": EngineStats, "info": EngineInfo,
                                    "reset_prefix_cache": Reset}


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True, kw_only=True):
    outputs: list[EngineCoreOutput] = []
    timestamp: float = msgspec.field(default_factory=time.monotonic)
    utility_call_id: int | None = None
    utility_result: UtilityResult | None = None
