"""Thinking first, then the constraint (`reasoning_end`, set by `formwork serve
--reasoning-parser` where the model writes `</think>` as one token).

A tiny random model whose tokenizer has `<think>` / `</think>` as added tokens
(as Qwen3's and DeepSeek-R1's have): the matcher's masks while thinking and
after the tag (against a plain request's), rollback across the tag, the end of
sequence refused while thinking; through the engine, outputs whose part after
the tag validates; through `formwork serve`, `reasoning` and a `content` that
validates (streamed too), and a prompt that closed the thinking constrained from
its first token.
"""
from __future__ import annotations

import json
import shutil
import time

import httpx
import jsonschema
import pytest
import torch

from formwork import LLM, SamplingParams, StructuredOutputsParams
from formwork.gateway.reasoning import split_reasoning
from formwork.grammar.backend import allowed_token_ids
from formwork.grammar.manager import StructuredOutputManager
from test_server import KEY, Server

VOCAB = 49160      # the tokenizer's 49152 + the two tags, padded
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
          "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory, tiny_model_dir):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("think-llama")
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.vocab_size = VOCAB
    torch.manual_seed(1)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_tokens(["<think>", "</think>"])           # added, not special (as Qwen3's)
    tok.save_pretrained(out)
    for name in ("chat_template.jinja", "generation_config.json"):
        if (tiny_model_dir / name).is_file() and not (out / name).is_file():
            shutil.copy(tiny_model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def tok(think_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(think_dir)


def _ready(m: StructuredOutputManager, rid: str) -> None:
    deadline = time.monotonic() + 60
    while m.status(rid) == "pending":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert m.status(rid) == "ready", m.error(rid)


def _row(m: StructuredOutputManager, rid: str) -> set[int]:
    return set(allowed_token_ids(m.fill_bitmask([rid]).clone(), 0, VOCAB))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_masks_while_thinking_and_after_the_tag(tok, backend):
    start, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    assert tok.encode("</think>", add_special_tokens=False) == [end]
    m = StructuredOutputManager(tok, VOCAB)
    so = StructuredOutputsParams(json=SCHEMA, backend=backend, whitespace="compact")
    m.submit("plain", so)
    m.submit("think", StructuredOutputsParams(json=SCHEMA, backend=backend, whitespace="compact",
                                              reasoning_end="</think>"))
    _ready(m, "plain")
    _ready(m, "think")
    first = _row(m, "plain")
    thinking = _row(m, "think")
    word = tok.encode(" Paris", add_special_tokens=False)
    assert {start, end, *word} <= thinking and tok.eos_token_id not in thinking
    assert not thinking & set(tok.all_special_ids)
    assert len(thinking) > 49000 and VOCAB - 1 not in thinking      # padding ids never
    assert not m.accept_tokens("think", [tok.eos_token_id])          # no end while thinking
    assert m.accept_tokens("think", [start, *word])
    assert _row(m, "think") == thinking
    assert m.accept_tokens("think", [end])
    assert _row(m, "think") == first                                   # the constraint now
    brace = tok.encode("{", add_special_tokens=False)
    assert m.accept_tokens("think", brace) and m.accept_tokens("plain", brace)
    assert _row(m, "think") == _row(m, "plain")
    assert not m.accept_tokens("think", [end])        # the tag is not JSON
    m._matcher("think").rollback(len(brace) + 1)      # back across the tag: thinking again
    assert _row(m, "think") == thinking
    assert m.accept_tokens("think", [end, *brace])
    assert _row(m, "think") == _row(m, "plain")
    m.submit("bad", StructuredOutputsParams(json=SCHEMA, reasoning_end="<nope>"))
    assert m.status("bad") == "failed" and "reasoning_end" in m.error("bad")


def test_the_engine_thinks_then_follows_the_schema(think_dir, tok):
    end = tok.convert_tokens_to_ids("</think>")
    llm = LLM(str(think_dir), engine_process=False, dtype="float32", num_kv_blocks=128,
              block_size=8)
    try:
        so = StructuredOutputsParams(json=SCHEMA, whitespace="compact", reasoning_end="</think>")
        # a bias on the tag: a random model writes it after a few tokens, then the JSON
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(
            n=6, temperature=1.0, seed=3, max_tokens=60, logit_bias={end: 9.5},
            structured_outputs=so), use_tqdm=False)[0].outputs
        thought = 0
        for c in outs:
            assert c.finish_reason == "stop", c.text
            assert c.token_ids.count(end) >= 1 and tok.eos_token_id not in c.token_ids[:-1]
            reasoning, content = split_reasoning("deepseek_r1", "", c.text)
            jsonschema.validate(json.loads(content), SCHEMA)
            thought += bool(reasoning)
        assert thought >= 2                  # most wrote some thinking before the tag
        plain = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(
            temperature=0, max_tokens=60, logit_bias={end: 9.5},
            structured_outputs=StructuredOutputsParams(json=SCHEMA, whitespace="compact")),
            use_tqdm=False)[0].outputs[0]
        assert end not in plain.token_ids and plain.text.startswith("{")
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def think_server(think_dir):
    s = Server(str(think_dir), "--reasoning-parser", "qwen3", "--dtype", "float32",
               "--max-model-len", "512", "--kv-cache-memory-gb", "0.05")
    yield s
    s.stop()


def _post(server, body):
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"})


@pytest.mark.parametrize("stream", [False, True])
def test_served_thinking_then_valid_content(think_server, tok, stream):
    end = tok.convert_tokens_to_ids("</think>")
    body = {"messages": [{"role": "user", "content": "Where?"}], "max_tokens": 60,
            "temperature": 1.0, "logit_bias": {str(end): 9.5}, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "c", "schema": SCHEMA, "strict": True}}}
    thought = 0
    for seed in range(4):
        r = _post(think_server, {**body, "seed": seed})
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
            deltas = [c["delta"] for e in events for c in e["choices"]]
            reasoning = "".join(d.get("reasoning") or "" for d in deltas)
            content = "".join(d.get("content") or "" for d in deltas)
            finish = [c for e in events for c in e["choices"] if c["finish_reason"]][-1]
            assert finish["finish_reason"] == "stop" and finish["formwork"]["valid"] is True
        else:
            choice = r.json()["choices"][0]
            msg = choice["message"]
            reasoning, content = msg.get("reasoning") or "", msg["content"]
            assert msg.get("reasoning_content") == msg.get("reasoning")
            assert choice["finish_reason"] == "stop" and choice["formwork"]["valid"] is True
        assert "</think>" not in content and "</think>" not in reasoning
        jsonschema.validate(json.loads(content), SCHEMA)
        thought += bool(reasoning)
    assert thought >= 1


def test_a_prompt_that_closed_the_thinking_is_constrained_at_once(think_server, tok):
    end = tok.convert_tokens_to_ids("</think>")
    r = _post(think_server, {
        "messages": [{"role": "user", "content": "Where?"},
                     {"role": "assistant", "content": "<think>\n\n</think>\n\n"}],
        "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 40,
        "temperature": 0, "logit_bias": {str(end): 9.5},
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert "reasoning" not in msg and msg["content"].startswith("{")
    jsonschema.validate(json.loads(msg["content"]), SCHEMA)


def test_a_required_tool_call_after_thinking(think_server, tok):
    end = tok.convert_tokens_to_ids("</think>")
    tool = {"type": "function", "function": {"name": "find", "parameters": SCHEMA}}
    calls = thought = 0
    for seed in range(3):
        r = _post(think_server, {
            "messages": [{"role": "user", "content": "Where?"}], "max_tokens": 240,
            "temperature": 1.0, "seed": seed, "logit_bias": {str(end): 9.5},
            "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        for call in choice["message"]["tool_calls"]:
            assert call["function"]["name"] == "find"
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
            calls += 1
        thought += bool(choice["message"].get("reasoning"))
    assert calls >= 3 and thought >= 1
