"""Offline API, shaped like vLLM's:

    from formwork import LLM, SamplingParams
    llm = LLM()                                  # default SmolLM2-135M-Instruct
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    outs[0].outputs[0].text, .token_ids, .finish_reason

All prompts are admitted to the EngineCore together and batched continuously
by its scheduler. The EngineCore runs in its own process by default (as vLLM
V1's does): the caller's own torch work cannot slow it, and it starts with the
OpenMP settings formwork chooses (gpu/cpu_threads.py). `LLM(engine_process=False)`
(or FORMWORK_ENGINE_PROCESS=0) keeps it in this process, where `llm.engine` is
the EngineCore itself (debugging, tests that look inside; `step_hooks` observes
its steps: core/step_hooks.py).

`LLM(data_parallel_size=N)` starts N engine processes, each with its own
scheduler and KV cache; prompts are spread over them by the server's rule
(least outstanding work, prefix affinity: gateway/dp_router.py) and the
results come back as with one engine, in prompt order.
"""
from __future__ import annotations

import itertools
import os
import time
from typing import Any, Callable, Sequence

from formwork.core.step_hooks import StepHooks
from formwork.gateway.errors import APIError
from formwork.gateway.limits import truncated_prompt
from formwork.gateway.metrics import Metrics, RequestTimer
from formwork.gateway.output_processor import OutputProcessor, RequestOutput
from formwork.schemas.config import EngineConfig
from formwork.schemas.errors import ParamError
from formwork.grammar.selection import validate_params
from formwork.gateway.beam_search import BeamSearch, BeamSearchOutput
from formwork.schemas.sampling import (BeamSearchParams, SamplingParams, check_priority,
                                       check_token_ids, resolve_bad_words, with_stop_ids)

PromptType = str | dict[str, Any]


# vLLM's LLM(...) arguments with nothing to do here, accepted so that a vLLM script
# runs unchanged: formwork's loader runs no model code (trust_remote_code), keeps no
# per-run statistics log, recomputes preempted requests instead of swapping them to
# CPU memory (swap_space), compiles no graphs through torch.compile's config, loads
# local files only (revision, download_dir), serves logprobs up to 20 whatever the cap.
_VLLM_NO_OPS = ("trust_remote_code", "disable_log_stats", "swap_space", "revision",
                "download_dir", "compilation_config", "max_logprobs", "served_model_name",
                "disable_custom_all_reduce", "async_scheduling")
# vLLM's arguments accepted at the value that changes nothing, refused otherwise
_VLLM_DEFAULTS = {"kv_cache_dtype": ("auto", "the KV cache is kept in the model's dtype"),
                  "quantization": (None, "weights are loaded in `dtype` (a GGUF file's "
                                         "quantized tensors are dequantized)"),
                  "cpu_offload_gb": (0, "weights are not offloaded"),
                  "tokenizer_mode": ("auto", "the model folder's tokenizer is used"),
                  "tokenizer": (None, "the model folder's own tokenizer is used")}


def vllm_engine_kwargs(kwargs: dict) -> dict:
    """`LLM(**kwargs)` as vLLM's `LLM` takes them -> EngineConfig's fields: the
    structured-output backend options mapped (`structured_outputs_config={"backend":
    ...}`, older `guided_decoding_backend`), the no-ops dropped, the others refused
    with ValueError naming them unless at the value that changes nothing."""
    out = dict(kwargs)
    for name in _VLLM_NO_OPS:
        out.pop(name, None)
    for name, (default, why) in _VLLM_DEFAULTS.items():
        if name in out:
            value = out.pop(name)
            if value != default and not (name == "tokenizer" and value == out.get("model")):
                raise ValueError(f"{name}: only {default!r} is supported ({why}), got {value!r}")
    if "distributed_executor_backend" in out and out["distributed_executor_backend"] is None:
        del out["distributed_executor_backend"]          # vLLM's None: its default
    so = out.pop("structured_outputs_config", None)
    backend = out.pop("guided_decoding_backend", None)
    if so is not None:
        backend = so.get("backend") if isinstance(so, dict) else getattr(so, "backend", None)
    if backend is not None:
        out.setdefault("structured_backend", backend)
    return out


def _validated(model, value, where: str):
    """`model.model_validate(value)`, or ValueError naming the first bad field
    (`messages[1].role: Input should be ...`) instead of pydantic's report."""
    from pydantic import ValidationError

    try:        # a model class, or a TypeAdapter of a union of them
        validate = getattr(model, "model_validate", None) or model.validate_python
        return validate(value)
    except ValidationError as e:
        from formwork.gateway.errors import describe_validation_errors

        raise ValueError(describe_validation_errors(e.errors(), where)[1]) from None


_UNSERVED_PROMPT_KEYS = {"multi_modal_data": "multimodal inputs",
                         "mm_processor_kwargs": "multimodal inputs",
                         "prompt_embeds": "prompt embeddings"}


def _check_unserved(lora_request: Any, tokenization_kwargs: dict | None) -> None:
    """vLLM's per-call arguments formwork does not serve: None / empty only."""
    if lora_request is not None:
        raise ValueError("lora_request: LoRA adapters are not served")
    if tokenization_kwargs:
        raise ValueError(f"tokenization_kwargs: not served (got {sorted(tokenization_kwargs)}); "
                         "text prompts get the tokenizer's special tokens, token ids are "
                         "taken as they are, truncate_prompt_tokens is a SamplingParams field")


def _engine_process_default() -> bool:
    value = os.environ.get("FORMWORK_ENGINE_PROCESS", "1").strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ValueError(f"FORMWORK_ENGINE_PROCESS: expected 0 or 1, got {value!r}")
    return value in ("1", "true", "yes", "on")


class LLM:
    def __init__(self, model: str | None = None, *, engine_process: bool | None = None,
                 step_hooks: StepHooks | None = None, generation_config: str = "auto",
                 override_generation_config: dict | None = None, **engine_kwargs):
        """`generation_config` / `override_generation_config`: vLLM's, where the default
        sampling parameters come from ("auto": the model folder's
        generation_config.json, "vllm": none, or a folder's; the override on top)."""
        self.config = EngineConfig(**vllm_engine_kwargs({"model": model, **engine_kwargs}))
        from formwork.gateway.serve_options import generation_defaults, generation_eos_ids
        from formwork.gpu.model_files import DEFAULT_MODEL, resolve_model
        folder = str(resolve_model(self.config.model, weights=False))
        # checked now: a folder without the file or a bad override key fails the start
        self._default_sampling = generation_defaults(generation_config, folder,
                                                     override_generation_config)
        if engine_process is None:
            engine_process = _engine_process_default()
        self._release = lambda: None
        if (self.config.data_parallel_size > 1
                or self.config.distributed_executor_backend == "ray") and not engine_process:
            raise ValueError("data_parallel_size > 1 and the ray backend run engines in their own "
                             "processes: leave engine_process at its default (True)")
        if step_hooks is not None and engine_process:
            raise ValueError("step_hooks: observe an engine in this process only; "
                             "pass engine_process=False")
        # each path imports only its own engine (in-process: torch and the executor here)
        if engine_process:
            from formwork.gateway.engine_factory import make_engine_process
            self.engine, self._release = make_engine_process(self.config)
        else:
            from formwork.core.engine_core import EngineCore
            self.engine = EngineCore(self.config, hooks=step_hooks)
        self.tokenizer = self.engine.tokenizer
        self._processor = OutputProcessor(self.tokenizer)
        self._metrics = Metrics(self.config.model or DEFAULT_MODEL)     # get_metrics()
        # the generation config's end ids beside the tokenizer's stop every request (as vLLM)
        self._extra_stop = generation_eos_ids(folder, self.tokenizer.eos_token_id)
        self._ids = itertools.count()

    # -- prompts ----------------------------------------------------------
    def _to_tokens(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):     # vLLM's prompt fields that ask for what is not served
            for key, what in _UNSERVED_PROMPT_KEYS.items():
                if prompt.get(key):
                    raise ValueError(f"prompt.{key}: {what} are not served")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            # the tokenizer's special tokens (a Llama-3 or Mistral BOS), as vLLM's generate
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
            if not ids:
                raise ValueError("prompt_token_ids: must not be empty")
            return prompt.get("prompt"), ids
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._to_tokens(prompt["prompt"])
        raise ValueError("prompt: expected a string, {'prompt': str} or {'prompt_token_ids': [...]}")

    # -- generation -------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True,
                 on_finished: Callable[[int, RequestOutput], None] | None = None,
                 priority: Sequence[int] | None = None, lora_request: Any = None,
                 tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """Outputs in prompt order. `on_finished(i, output)` (optional) is called
        as soon as prompt i finishes, in completion order, e.g. to write results
        incrementally; an exception from it aborts the remaining requests.
        `priority` (as vLLM): one per prompt, lower served earlier; needs
        scheduling_policy="priority" (a value other than 0 is refused otherwise).
        vLLM's `lora_request` must be None (no adapters are served) and
        `tokenization_kwargs` empty (text prompts get the tokenizer's special tokens,
        token-id prompts are taken as they are): a script passing them runs, one
        asking for what is not served gets a ValueError naming it."""
        _check_unserved(lora_request, tokenization_kwargs)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
        if any(s is not None for s in salts):     # vLLM's prompt field: {"prompt", "cache_salt"}
            params = [p if s is None else p.clone(cache_salt=s) for p, s in zip(params, salts)]
            for p in params:
                p.validate()
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"priority: got {len(priority)} for {len(prompts)} prompts")
            params = [p.clone(priority=int(v)) for p, v in zip(params, priority)]
            for p in params:
                p.validate()
        # the entry's checks, all before admitting anything: a bad prompt fails the call, not
        # the engine (each SamplingParams checked itself when it was built)
        tokenized = [self._truncated(self._to_tokens(prompt), p.truncate_prompt_tokens)
                     for prompt, p in zip(prompts, params)]
        # extra_args are read by nothing here: they stay in the caller's object and do
        # not travel to the engine (any Python value may be in them)
        params = [with_stop_ids(p.clone(extra_args=None) if p.extra_args is not None else p,
                                self._extra_stop) for p in params]
        for (_, ids), p in zip(tokenized, params):
            self.engine.check_prompt(ids)
            resolve_bad_words(p, self.tokenizer)
            check_token_ids(p, self.engine.vocab_size)
            check_priority(p, self.config.scheduling_policy)
        self._check_constraints(params)
        order, textless = [], set()
        for (text, ids), p in zip(tokenized, params):
            rid = str(next(self._ids))
            order.append(rid)
            if not p.detokenize:
                textless.add(rid)
            try:
                for er in self._processor.add_request(rid, text, ids, p, time.monotonic()):
                    self.engine.add_request(er)
            except Exception:
                self._abort(order)
                raise
        return self._run(order, use_tqdm, on_finished, textless)

    def _truncated(self, prompt: tuple[str | None, list[int]],
                   k: int | None) -> tuple[str | None, list[int]]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the context
        length); the prompt text is then the kept tokens' text."""
        text, ids = prompt
        if k is None:
            return prompt
        try:
            kept = truncated_prompt(ids, k, self.engine.max_model_len)
        except APIError as e:
            raise ParamError("truncate_prompt_tokens", e.message.split(": ", 1)[-1]) from None
        if len(kept) == len(ids):
            return prompt
        return self.tokenizer.decode(kept, skip_special_tokens=False), kept

    def _check_constraints(self, params: list[SamplingParams]) -> None:
        """Each distinct output constraint checked as the server checks it before a
        400 (schema against its meta-schema, keywords some backend enforces, regex and
        grammar syntax, a finite output): a ValueError naming `structured_outputs`
        from `generate` itself, as vLLM's LLM raises, not an empty output whose
        finish_reason is "error". Compiles nothing against the tokenizer; equal
        constraints (one per prompt, built alike) are checked once."""
        checked: set[str] = set()
        for p in params:
            so = p.structured_outputs
            if so is None:
                continue
            try:
                key = so.cache_key()
                if key not in checked:
                    validate_params(so, self.config.structured_backend)
                    checked.add(key)
            except ParamError:
                raise                               # names its field already
            except ValueError as err:
                raise ParamError("structured_outputs", str(err)) from None

    def _abort(self, rids: list[str]) -> None:
        engine_ids = [eid for rid in rids for eid in self._processor.abort_request(rid)]
        self.engine.abort_requests(engine_ids)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def _run(self, order: list[str], use_tqdm: bool,
             on_finished: Callable[[int, RequestOutput], None] | None = None,
             textless: set[str] = frozenset()) -> list[RequestOutput]:
        """`textless`: the requests of detokenize=False, whose outputs carry no text."""
        finished: dict[str, RequestOutput] = {}
        index = {rid: i for i, rid in enumerate(order)}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(order), desc="Processed prompts", unit="req", dynamic_ncols=True)
        n_out = 0
        t0 = time.perf_counter()
        timers = {rid: RequestTimer() for rid in order}
        try:
            while len(finished) < len(order):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("engine has no work left but requests are unfinished")
                outs = self.engine.step().outputs
                results, to_abort = self._processor.process_outputs(outs)
                if to_abort:
                    self.engine.abort_requests(to_abort)
                for ro in results:
                    timer = timers[ro.request_id]
                    timer.on_tokens(sum(len(c.delta_token_ids) for c in ro.outputs))
                    if ro.finished:
                        self._metrics.observe_finished(timer, len(ro.prompt_token_ids),
                                                       [c.finish_reason for c in ro.outputs])
                        for c in ro.outputs:     # vLLM's shape: [{token_id: Logprob}, ...]
                            if c.logprobs is not None:
                                c.logprobs = self._processor.sample_logprobs(c.logprobs)
                            if ro.request_id in textless:    # detokenize=False: token ids
                                c.text = c.delta_text = ""
                        finished[ro.request_id] = ro
                        n_out += sum(len(c.token_ids) for c in ro.outputs)
                        if on_finished is not None:
                            on_finished(index[ro.request_id], ro)
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix_str(f"out {n_out / (time.perf_counter() - t0):.1f} tok/s")
        except BaseException:
            self._abort([r for r in order if r not in finished])
            raise
        finally:
            if bar is not None:
                bar.close()
        # drain aborts of stop-string requests so no blocks stay held
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return [finished[r] for r in order]

    def chat(self, messages, sampling_params=None, *, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None,
             on_finished: Callable[[int, RequestOutput], None] | None = None,
             lora_request: Any = None, chat_template_content_format: str = "auto",
             mm_processor_kwargs: dict | None = None,
             tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """messages: one conversation (OpenAI chat messages: roles system / developer /
        user / assistant / tool, string or text-part content, assistant `tool_calls`)
        or a list of them. Rendered exactly as the server renders a chat request
        (gateway/chat.py): `tools` (OpenAI's `[{"type": "function", "function":
        {...}}]`) go to a template that knows tools, else into a Hermes-style system
        prompt, as `tool_choice: "auto"` does. The output is the model's text: no tool
        call parsing and no tool grammar here (the server's /v1/chat/completions does
        both). `continue_final_message` continues the last (assistant) message
        instead of opening a new turn; `chat_template` replaces the tokenizer's
        template. `RequestOutput.prompt` is the rendered text; `on_finished` as in
        `generate`. A malformed conversation raises ValueError naming the field."""
        from formwork.gateway.chat import build_chat_prompt
        from formwork.gateway.errors import APIError
        from formwork.gateway.tools import ToolMode
        from pydantic import TypeAdapter

        from formwork.schemas.openai import AnyTool, ChatMessage

        _check_unserved(lora_request, tokenization_kwargs)
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError("chat_template_content_format: 'auto' or 'string' (text parts are "
                             f"joined into one string), got {chat_template_content_format!r}")
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: multimodal inputs are not served")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message: set add_generation_prompt=False with it "
                             "(as vLLM), the last message is continued instead of a new turn")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        any_tool = TypeAdapter(AnyTool)
        mode = ToolMode("auto" if tools else "none", tuple(
            _validated(any_tool, t, f"tools[{i}]").definition() for i, t in enumerate(tools or ())))
        kwargs = dict(chat_template_kwargs or {})
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        prompts = []
        for k, conv in enumerate(convs):
            where = "messages" if len(convs) == 1 else f"messages[{k}]"
            if not conv:
                raise ValueError(f"{where}: a conversation needs at least one message")
            msgs = [_validated(ChatMessage, m, f"{where}[{i}]") for i, m in enumerate(conv)]
            try:
                text, ids = build_chat_prompt(
                    self.tokenizer, msgs, mode, kwargs, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message, chat_template=chat_template)
            except APIError as e:
                raise ValueError(f"{where}: {e.message}" if len(convs) > 1 else e.message) from None
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, on_finished=on_finished)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: Any = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search` (gateway/beam_search.py): per prompt, the best
        `params.beam_width` sequences, best first; each round runs every live beam
        of every prompt as one batch of one-token requests. `lora_request` must be
        None (no adapters are served); `use_tqdm` and `concurrency_limit` (vLLM's)
        change nothing here."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not served")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        tokenized = [self._to_tokens(p) for p in prompts]
        for _, ids in tokenized:
            self.engine.check_prompt(ids)
        eos = self.tokenizer.eos_token_id
        searches = [BeamSearch(ids, params.beam_width, params.max_tokens, eos,
                               ignore_eos=params.ignore_eos, length_penalty=params.length_penalty,
                               max_model_len=self.engine.max_model_len)
                    for _, ids in tokenized]
        one = SamplingParams(max_tokens=1, temperature=params.temperature,
                             logprobs=2 * params.beam_width, ignore_eos=True)
        while live := [(s, b) for s in searches for b in s.live()]:
            outs = self.generate([{"prompt_token_ids": b.tokens} for _, b in live], one,
                                 use_tqdm=False)
            tops = {id(s): [] for s in searches}
            for (s, _), out in zip(live, outs):
                entry = out.outputs[0].logprobs[0]
                tops[id(s)].append({t: lp.logprob for t, lp in entry.items()})
            for s in searches:
                if s.live():
                    s.advance(tops[id(s)])
        return [s.result(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
                for s in searches]

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the generation config's sampling values (temperature, top_p, top_k,
        min_p, repetition_penalty, max_new_tokens as max_tokens; `generation_config`
        picks the file) over SamplingParams' defaults; `generate` uses them when given
        no sampling_params."""
        return SamplingParams(**self._default_sampling)

    def get_tokenizer(self):
        """The engine's Hugging Face tokenizer (as vLLM's `LLM.get_tokenizer()`)."""
        return self.tokenizer

    def get_stats(self):
        return self.engine.get_stats()

    def get_metrics(self) -> list:
        """vLLM's `LLM.get_metrics()`: every metric as a Counter, Gauge or Histogram
        (`formwork.v1.metrics.reader`, vLLM's `vllm.v1.metrics.reader`) with the
        server's /metrics names: requests by finish reason, prompt and generation
        tokens, latency histograms of `generate`/`chat` calls, the engine's queues, KV
        usage, prefix cache, preemptions and grammar work."""
        from formwork.gateway.metrics_reader import snapshot
        self._metrics.set_engine_stats(self.engine.get_stats())
        return snapshot(self._metrics.registry)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's `LLM.reset_prefix_cache()`, e.g. between
        benchmark runs so that the second finds no cached prompts); False, and nothing
        changed, while requests are running (never the case between `generate` calls)."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()
        self._release()          # the Ray backend's placement group
