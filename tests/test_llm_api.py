"""The offline `LLM` as a vLLM user calls it: `CompletionOutput.logprobs` in vLLM's
shape (a `{token_id: Logprob(logprob, rank, decoded_token)}` per generated token,
checked against HF transformers), `get_tokenizer()`, and `chat()` rendering a
conversation as the server does (tools, tool-call history, text parts,
`continue_final_message`, `chat_template`), with errors naming the field."""
from __future__ import annotations

import json

import pytest

from formwork import LLM, Logprob, SamplingParams
from test_prompt_logprobs import _check_entry, _ids, hf_logprobs, tiny_hf  # noqa: F401 (fixture)

K = 3
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def llm(tiny_llm):
    return tiny_llm


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0, seed=7)])
def test_sample_logprobs_have_vllms_shape_and_match_hf(llm, tiny_hf, params):
    prompts = [_ids(11, 1), _ids(4, 2)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=5, logprobs=K, **params), use_tqdm=False)
    tok = llm.get_tokenizer()
    ranks = []
    for o, prompt in zip(outs, prompts):
        c = o.outputs[0]
        ref = hf_logprobs(tiny_hf, prompt + c.token_ids)[len(prompt) - 1:]
        assert len(c.logprobs) == len(c.token_ids) == 5
        for j, (tid, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert isinstance(entry, dict) and next(iter(entry)) == tid     # the pick first
            assert all(isinstance(v, Logprob) for v in entry.values())
            _check_entry(entry, tid, ref[j], K)
            assert entry[tid].decoded_token == tok.decode([tid])
            ranks.append(entry[tid].rank)
        assert c.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)), abs=1e-4)
    if params["temperature"] == 0:
        assert set(ranks) == {1}
    else:                      # a random tiny model is nearly flat: draws are rarely its best
        assert max(ranks) > K


def test_chat_renders_tools_history_and_parts_as_the_server_does(llm):
    conv = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in "},
                                         {"type": "text", "text": "Paris?"}]},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}]
    out = llm.chat(conv, SamplingParams(max_tokens=3, temperature=0), tools=TOOLS, use_tqdm=False)[0]
    p = out.prompt
    # the default model's ChatML template knows no tools: the server's Hermes system prompt
    assert p.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"get_weather"' in p
    assert "Weather in Paris?" in p
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in p
    assert "<tool_response>\n18C, sunny\n</tool_response>" in p
    assert p.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == llm.get_tokenizer().encode(p, add_special_tokens=False)
    plain = llm.chat(conv[:2], SamplingParams(max_tokens=3), use_tqdm=False)[0].prompt
    assert "# Tools" not in plain
    # a custom tool (OpenAI's) and its call in the history: as the server renders them
    custom = [{"type": "custom", "custom": {"name": "calc", "format": {
        "type": "grammar", "grammar": {"syntax": "regex", "definition": "[0-9]+"}}}}]
    conv = conv[:2] + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "custom", "custom": {"name": "calc", "input": "6*7"}}]}]
    p = llm.chat(conv, SamplingParams(max_tokens=1), tools=custom, use_tqdm=False)[0].prompt
    assert '"name": "calc"' in p and "[0-9]+" in p
    assert '<tool_call>\n{"name": "calc", "arguments": {"input": "6*7"}}\n</tool_call>' in p
    with pytest.raises(ValueError, match=r"tools\[0\]\.custom"):
        llm.chat(conv[:2], SamplingParams(max_tokens=1), tools=[{"type": "custom"}],
                 use_tqdm=False)


def test_chat_continue_final_message_and_own_template(llm):
    conv = [{"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "My favourite colour is"}]
    sp = SamplingParams(max_tokens=2, temperature=0)
    out = llm.chat(conv, sp, add_generation_prompt=False, continue_final_message=True,
                   use_tqdm=False)[0]
    assert out.prompt.endswith("<|im_start|>assistant\nMy favourite colour is")
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    own = llm.chat(conv[:1], sp, chat_template=template, use_tqdm=False)[0]
    assert own.prompt == "[user] Name a colour.\n"
    batch = llm.chat([conv[:1], conv[:1]], sp, use_tqdm=False)
    assert len(batch) == 2 and batch[0].prompt == batch[1].prompt


@pytest.mark.parametrize("convs, kw, match", [
    ([{"role": "robot", "content": "hi"}], {}, r"^messages\[0\]\.role: Input should be"),
    ([[{"role": "user", "content": "ok"}], [{"role": "user", "content": 5}]], {},
     r"^messages\[1\]\[0\]\.content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
     r"^messages\[0\]\.content: only text content parts"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}], {},
     r"^messages\[0\]\.content\[1\]\.text: a text part needs its 'text' string"),
    ([{"role": "user", "content": "hi"}], {"continue_final_message": True},
     "^continue_final_message: set add_generation_prompt=False"),
    ([{"role": "user", "content": "hi"}], {"tools": [{"type": "function"}]},
     r"^tools\[0\]\.function: Field required"),
    ([[]], {}, "^messages: a conversation needs at least one message"),
    ([{"role": "user", "content": "hi"}, {"role": "user"}], {},
     r"^messages\[1\]\.content: Field required for a user message"),
])
def test_chat_errors_name_the_field(llm, convs, kw, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(convs, SamplingParams(max_tokens=2), use_tqdm=False, **kw)
    assert not llm.engine.has_unfinished_requests()


def test_prompt_cache_salt_partitions_prefix_hits(llm):
    """vLLM's prompt field `cache_salt`: cached blocks are reused within a salt only."""
    ids = _ids(33, 9)                                   # 4 full blocks of 8
    sp = SamplingParams(max_tokens=1, temperature=0)

    def cached(salt):
        prompt = {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids,
                                                                 "cache_salt": salt}
        return llm.generate(prompt, sp, use_tqdm=False)[0].num_cached_tokens

    assert cached("a") == 0 and cached("a") == 32
    assert cached("b") == 0 and cached(None) == 0 and cached(None) == 32
    with pytest.raises(ValueError, match="^cache_salt"):
        llm.generate({"prompt_token_ids": ids, "cache_salt": ""}, sp, use_tqdm=False)


def test_reset_prefix_cache_forgets_cached_prompts_but_not_while_running(llm):
    """vLLM's `LLM.reset_prefix_cache()`: the next run of a prompt finds nothing
    cached; refused (False, the cache kept) while requests hold blocks."""
    ids = _ids(33, 11)                                  # 4 full blocks of 8
    sp = SamplingParams(max_tokens=1, temperature=0)

    def cached():
        return llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0].num_cached_tokens

    cached()
    assert cached() == 32
    assert llm.reset_prefix_cache() is True
    assert cached() == 0 and cached() == 32
    answers = []
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": _ids(20, 12)}],
                 [sp, long], use_tqdm=False,
                 on_finished=lambda i, o: answers.append(llm.reset_prefix_cache()))
    # the first finished while the long one ran: refused; the long one's own callback
    # comes once its blocks are back
    assert answers == [False, True]
    assert cached() == 0


def test_logprobs_where_the_grammar_forces_the_continuation_are_the_models(llm, tiny_hf):
    """A constraint that forces a long continuation: with logprobs asked, every
    position carries the model's own numbers (raw mode, checked against HF), not a
    p = 1 for tokens the grammar forced (jump-forward is off for such a request);
    without logprobs the same request jumps forward through the same text."""
    from formwork import StructuredOutputsParams

    prompt = _ids(5, 3)
    so = dict(regex=r"x( is a forced continuation of several tokens)[0-9]")
    sp = SamplingParams(max_tokens=30, temperature=0, logprobs=K,
                        structured_outputs=StructuredOutputsParams(**so))
    c = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.text.startswith("x is a forced continuation")
    assert len(c.logprobs) == len(c.token_ids) > 5
    ref = hf_logprobs(tiny_hf, prompt + c.token_ids)[len(prompt) - 1:]
    for j, (tid, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        assert next(iter(entry)) == tid
        _check_entry(entry, tid, ref[j], K)       # a random tiny model: far from p = 1
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        max_tokens=30, temperature=0, structured_outputs=StructuredOutputsParams(**so)),
        use_tqdm=False)[0].outputs[0]
    # the digit after it is the model's pick over another tokenization of the
    # same text (jump-forward writes the canonical one): it may differ
    assert plain.text[:-1] == c.text[:-1] and plain.logprobs is None


def test_vllm_constructor_arguments(tiny_model_dir):
    """A vLLM script's LLM(...) runs unchanged: the no-op arguments are taken, the
    structured-output backend option is mapped, the rest is refused by name."""
    from formwork.gateway.llm import vllm_engine_kwargs

    llm = LLM(str(tiny_model_dir), engine_process=False, dtype="float32", num_kv_blocks=16,
              trust_remote_code=True, disable_log_stats=True, swap_space=4, kv_cache_dtype="auto",
              enable_prefix_caching=False, structured_outputs_config={"backend": "xgrammar"})
    try:
        assert llm.config.structured_backend == "xgrammar"
        assert not llm.config.enable_prefix_caching
    finally:
        llm.shutdown()
    assert vllm_engine_kwargs({"model": "m", "guided_decoding_backend": "outlines",
                               "tokenizer": "m"}) == {"model": "m", "structured_backend": "outlines"}
    for bad in ({"kv_cache_dtype": "fp8"}, {"quantization": "awq"}, {"tokenizer": "other/dir"},
                {"cpu_offload_gb": 4}):
        with pytest.raises(ValueError, match=f"^{next(iter(bad))}: only"):
            vllm_engine_kwargs({"model": "m", **bad})
    with pytest.raises(TypeError, match="no_such_argument"):
        LLM(str(tiny_model_dir), engine_process=False, no_such_argument=1)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_min_tokens_never_outlives_the_grammars_end(llm, temperature):
    """min_tokens bans the end tokens, but a constrained output the grammar has
    ended (only the end allowed) ends there: before, the row had no token left and
    the request failed with "grammar rejected token"."""
    from formwork import StructuredOutputsParams

    cases = [(StructuredOutputsParams(choice=["yes", "no"]), {"yes", "no"}),
             (StructuredOutputsParams(json={"type": "boolean"}), {"true", "false"})]
    for so, texts in cases:
        outs = llm.generate([{"prompt_token_ids": _ids(6, s)} for s in range(4)],
                            SamplingParams(max_tokens=12, min_tokens=5, temperature=temperature,
                                           seed=1, structured_outputs=so), use_tqdm=False)
        for o in outs:
            c = o.outputs[0]
            assert (c.finish_reason, c.error) == ("stop", None) and c.text in texts, c
    # unconstrained, min_tokens still holds
    out = llm.generate({"prompt_token_ids": _ids(6, 9)},
                       SamplingParams(max_tokens=12, min_tokens=5, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 5


def test_a_constraint_nothing_can_continue_fails_saying_so(llm):
    """A regex of UTF-16 surrogates compiles (xgrammar) but no UTF-8 text matches it:
    the mask allows nothing, and the request failed with a bare "grammar rejected
    token". It still fails alone, saying why; the next request is served."""
    from formwork import StructuredOutputsParams

    out = llm.generate({"prompt_token_ids": _ids(6, 1)}, SamplingParams(
        max_tokens=4, temperature=0,
        structured_outputs=StructuredOutputsParams(regex="[\\ud800-\\udfff]")), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.finish_reason == "error" and "admits no token here" in c.error, c
    ok = llm.generate({"prompt_token_ids": _ids(6, 1)}, SamplingParams(
        max_tokens=4, temperature=0, structured_outputs=StructuredOutputsParams(regex="[ab]+")),
        use_tqdm=False)[0].outputs[0]
    assert ok.error is None and set(ok.text) <= {"a", "b"} and ok.text


@pytest.mark.parametrize("so,match", [
    (dict(json={"type": "nope"}), r"invalid JSON Schema at \$\.type"),
    (dict(json={"type": "array", "items": {"type": "object"}, "uniqueItems": True, "not": {}}),
     "unsupported JSON Schema keyword"),
    (dict(regex="(a"), "parenthesis is not closed"),
    (dict(grammar="root ::= undefined_rule"), "grammar"),
])
def test_an_unservable_constraint_raises_before_anything_runs(llm, so, match):
    """As vLLM's LLM (and the server's 400): `generate` raises ValueError naming
    structured_outputs and the reason, admits none of the call's prompts, and the
    next call is served. It returned an empty output with finish_reason "error"."""
    from formwork import StructuredOutputsParams

    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**so))
    fine = SamplingParams(max_tokens=4, temperature=0)
    with pytest.raises(ValueError, match=match) as e:
        llm.generate([{"prompt_token_ids": _ids(6, 1)}] * 2, [fine, bad], use_tqdm=False)
    assert e.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate({"prompt_token_ids": _ids(6, 1)}, fine, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_equal_constraints_are_checked_once_per_call(llm, monkeypatch):
    """One SamplingParams per prompt, each with its own equal constraint (as a loop
    builds them): the pre-admission check runs once, not once per prompt."""
    import formwork.gateway.llm as llm_module
    from formwork import StructuredOutputsParams

    calls = []
    real = llm_module.validate_params
    monkeypatch.setattr(llm_module, "validate_params",
                        lambda *a: (calls.append(a), real(*a))[1])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    sps = [SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(json=dict(schema)))
           for _ in range(6)]
    llm.generate([{"prompt_token_ids": _ids(6, 1)}] * 6, sps, use_tqdm=False)
    assert len(calls) == 1


def test_vllm_structured_outputs_flags(llm):
    """vLLM's StructuredOutputsParams flags are taken offline: disable_any_whitespace
    gives compact JSON (no whitespace the schema does not ask for)."""
    from formwork import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True, disable_fallback=True,
                                 disable_additional_properties=True)
    assert (so.whitespace, so.additional_properties, so.disable_any_whitespace) == \
        ("compact", "declared", False)
    outs = llm.generate([{"prompt_token_ids": _ids(5, s)} for s in range(3)],
                        SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                                       structured_outputs=so), use_tqdm=False)
    done = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert done
    for text in done:
        assert not any(ch.isspace() for ch in text) and set(json.loads(text)) == {"a", "b"}, text


def test_default_sampling_params_follow_the_generation_config(tiny_model_dir, tmp_path):
    """vLLM's LLM(generation_config=..., override_generation_config=...): where
    get_default_sampling_params (and generate without sampling_params) take their
    values; "vllm" takes none; a folder without the file fails the start."""
    import json
    import shutil

    from formwork import LLM

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.3, "top_k": 7, "max_new_tokens": 5, "eos_token_id": 2}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    small = dict(engine_process=False, dtype="float32", num_kv_blocks=16, block_size=8,
                 distributed_executor_backend=None)
    for kwargs, want in (({}, (0.3, 7, 5, 1.0)), ({"generation_config": "vllm"}, (1.0, 0, 16, 1.0)),
                         ({"generation_config": str(other)}, (1.0, 0, 16, 0.5)),
                         ({"override_generation_config": {"top_k": 3}}, (0.3, 3, 5, 1.0))):
        llm = LLM(str(folder), **small, **kwargs)
        try:
            sp = llm.get_default_sampling_params()
            assert (sp.temperature, sp.top_k, sp.max_tokens, sp.top_p) == want, kwargs
            if not kwargs:
                assert len(llm.generate("Hello")[0].outputs[0].token_ids) <= 5
        finally:
            llm.shutdown()
    with pytest.raises(ValueError, match="generation_config"):
        LLM(str(folder), **small, generation_config=str(tmp_path / "none"))


def test_vllm_sampling_fields_and_call_arguments(llm):
    """What vLLM scripts pass beside formwork's own fields: truncate_prompt_tokens (the
    last k prompt tokens, as generating from those ids), detokenize=False (token ids
    only), guided_decoding / GuidedDecodingParams (the older structured-outputs
    names), lora_request=None; what is not served is a ValueError naming it."""
    from formwork.sampling_params import GuidedDecodingParams
    ids = _ids(40, 3)
    greedy = dict(max_tokens=4, temperature=0)
    cut = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(truncate_prompt_tokens=7, **greedy), use_tqdm=False)[0]
    ref = llm.generate([{"prompt_token_ids": ids[-7:]}], SamplingParams(**greedy),
                       use_tqdm=False, lora_request=None)[0]
    assert cut.prompt_token_ids == ids[-7:] and cut.outputs[0].token_ids == ref.outputs[0].token_ids
    whole = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        truncate_prompt_tokens=-1, **greedy), use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids
    # vLLM's RequestOutput / CompletionOutput fields a script may read
    assert whole.metrics is None and whole.lora_request is None and whole.encoder_prompt is None
    assert whole.kv_transfer_params is None and whole.outputs[0].lora_request is None
    choice = GuidedDecodingParams(choice=["yes", "no"])
    quiet = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        detokenize=False, guided_decoding=choice, **greedy), use_tqdm=False)[0].outputs[0]
    loud = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        structured_outputs=choice, **greedy), use_tqdm=False)[0].outputs[0]
    assert quiet.text == "" and loud.text in ("yes", "no")
    plugin = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        extra_args={"any": object()}, **greedy), use_tqdm=False)[0]      # never sent on
    assert plugin.outputs[0].token_ids == whole.outputs[0].token_ids
    assert quiet.token_ids == loud.token_ids
    for kw, match in ((dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
                      (dict(logits_processors=[lambda ids, x: x]), "logits_processors"),
                      (dict(detokenize=False, stop=["."]), "detokenize"),
                      (dict(guided_decoding=choice, structured_outputs=choice), "guided_decoding")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(truncate_prompt_tokens=10**6),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="prompt.multi_modal_data"):   # not answered without it
        llm.generate([{"prompt": "Describe it.", "multi_modal_data": {"image": b"..."}}],
                     use_tqdm=False)
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate([{"prompt_token_ids": ids}], lora_request=object(), use_tqdm=False)
    with pytest.raises(ValueError, match="tokenization_kwargs"):
        llm.generate([{"prompt_token_ids": ids}], tokenization_kwargs={"truncation": True})
    conv = [{"role": "user", "content": "hi"}]
    for kw, match in ((dict(mm_processor_kwargs={"x": 1}), "mm_processor_kwargs"),
                      (dict(chat_template_content_format="openai"), "chat_template_content")):
        with pytest.raises(ValueError, match=match):
            llm.chat(conv, SamplingParams(max_tokens=1), use_tqdm=False, **kw)
    assert llm.chat(conv, SamplingParams(max_tokens=1), use_tqdm=False, lora_request=None,
                    chat_template_content_format="string")[0].outputs[0].token_ids


def test_get_metrics_counts_what_generate_did(llm):
    """vLLM's `LLM.get_metrics()` and its reader types (`formwork.v1.metrics.reader`):
    the token and request counters move by what one `generate` did, the latency
    histograms gain one observation per request, the engine's gauges read idle after."""
    from formwork.v1.metrics.reader import Counter, Gauge, Histogram

    def read():
        ms = llm.get_metrics()
        assert all(isinstance(m, (Counter, Gauge, Histogram)) for m in ms)
        counters = {(m.name, m.labels.get("finished_reason")): m.value for m in ms
                    if isinstance(m, Counter)}
        hist = {m.name: m for m in ms if isinstance(m, Histogram)}
        gauges = {m.name: m.value for m in ms if isinstance(m, Gauge)}
        return counters, hist, gauges

    before, h0, _ = read()
    outs = llm.generate([{"prompt_token_ids": _ids(9, 3)}, {"prompt_token_ids": _ids(5, 4)}],
                        [SamplingParams(max_tokens=6, ignore_eos=True),
                         SamplingParams(max_tokens=4, n=2, ignore_eos=True)], use_tqdm=False)
    after, h1, gauges = read()
    made = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert made == 14
    for prefix in ("vllm:", "formwork_"):
        assert after[(f"{prefix}generation_tokens", None)] - \
            before.get((f"{prefix}generation_tokens", None), 0) == made
        assert after[(f"{prefix}prompt_tokens", None)] - \
            before.get((f"{prefix}prompt_tokens", None), 0) == 14
        assert after[(f"{prefix}request_success", "length")] - \
            before.get((f"{prefix}request_success", "length"), 0) == 3
        e2e = f"{prefix}e2e_request_latency_seconds"
        assert h1[e2e].count - (h0[e2e].count if e2e in h0 else 0) == 2
        assert h1[e2e].buckets["+Inf"] == h1[e2e].count and h1[e2e].sum > 0
    assert gauges["vllm:num_requests_running"] == 0 and gauges["vllm:kv_cache_usage_perc"] == 0
    stats = llm.get_stats()
    assert after[("vllm:num_preemptions", None)] == stats.num_preemptions
    assert after[("vllm:prefix_cache_queries", None)] == stats.prefix_cache_queries


@pytest.mark.parametrize("choices", [["ok\ufffd"], ["\ufffd"], ["x\ufffdy", "b\ufffd"]])
def test_an_output_ending_in_a_replacement_character_keeps_it(llm, choices):
    """The detokenizer holds back text that ends in U+FFFD (its bytes may be an
    unfinished character) until the next token tells; at the end of the output
    nothing told, and a `choice` of "ok\ufffd" came back "ok": not one of the choices.
    The end flushes what is held back (the whole output decoded)."""
    from formwork import StructuredOutputsParams
    for t in (0.0, 1.0):
        sp = SamplingParams(max_tokens=12, temperature=t, seed=3,
                            structured_outputs=StructuredOutputsParams(choice=choices))
        out = llm.generate("Pick one:", sp, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.text in choices, out.text
        assert out.text == llm.get_tokenizer().decode(out.token_ids[:-1])
