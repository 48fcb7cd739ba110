"""POST /tokenize and /detokenize (vLLM's shapes).

Fast tests run the app's routes in-process (no engine: these endpoints only use
the tokenizer) against the HF tokenizer as reference; slow ones check against
the real server that the messages form counts what a chat completion bills.
"""
from __future__ import annotations

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from formwork.gateway.api_server import build_app
from formwork.gateway.metrics import Metrics
from formwork.gateway.serving import ServerState
from formwork.schemas.config import EngineConfig
from test_server import KEY, Server

AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_LEN = 1024
TEXTS = ["Hello, world!", "  leading spaces\nand a newline\n", "Grüße, 東京 🚀 — naïve café",
         "<|im_start|>user\nraw template text<|im_end|>", ""]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": [{"type": "text", "text": "Another"}, {"type": "text", "text": "?"}]}],
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="module")
def api(tokenizer):
    """The real app's routes and middleware; its lifespan (engine start) does not run."""
    app = build_app(EngineConfig(), served_model_names=["m"], api_key=KEY)
    app.state.server = ServerState(engine=None, tokenizer=tokenizer, served_model_names=("m",),
                                   max_model_len=MAX_LEN, metrics=Metrics("m"), api_key=KEY)
    return TestClient(app)


def post(api, path: str, body, headers=AUTH) -> httpx.Response:
    return api.post(path, json=body, headers=headers)


def template_text(tokenizer, messages, **kw) -> str:
    kw.setdefault("add_generation_prompt", True)
    return tokenizer.apply_chat_template(messages, tokenize=False, **kw)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("special", [True, False])
def test_prompt_form_is_the_tokenizer_and_round_trips(api, tokenizer, text, special):
    r = post(api, "/tokenize", {"model": "m", "prompt": text, "add_special_tokens": special})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer(text, add_special_tokens=special).input_ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_LEN
    assert body["token_strs"] is None
    back = post(api, "/detokenize", {"model": "m", "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_token_strs_and_default_model(api, tokenizer):
    body = post(api, "/tokenize", {"prompt": "Hello there", "return_token_strs": True}).json()
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert post(api, "/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": "Hello there"}


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_messages_form_is_the_chat_prompt(api, tokenizer, messages):
    plain = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
              else "".join(p["text"] for p in m["content"])} for m in messages]
    for kw in ({}, {"add_generation_prompt": False}):
        body = post(api, "/tokenize", {"messages": messages, **kw}).json()
        text = template_text(tokenizer, plain, **kw)
        assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False), kw
        assert post(api, "/detokenize", {"tokens": body["tokens"]}).json()["prompt"] == text


def test_continue_final_message_leaves_the_reply_open(api, tokenizer):
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi the"}]
    kw = {"add_generation_prompt": False, "continue_final_message": True}
    body = post(api, "/tokenize", {"messages": msgs, **kw}).json()
    text = template_text(tokenizer, msgs, **kw)
    assert text.endswith("Hi the")
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False)


def test_tools_are_in_the_prompt_unless_tool_choice_none(api):
    msgs = CONVERSATIONS[0]
    plain = post(api, "/tokenize", {"messages": msgs}).json()["count"]
    with_tools = post(api, "/tokenize", {"messages": msgs, "tools": [WEATHER]}).json()
    off = post(api, "/tokenize", {"messages": msgs, "tools": [WEATHER], "tool_choice": "none"})
    assert with_tools["count"] > plain and off.json()["count"] == plain
    assert "get_weather" in post(api, "/detokenize", {"tokens": with_tools["tokens"]}).json()["prompt"]
    # a custom tool (OpenAI's) is counted as the chat request renders it
    calc = {"type": "custom", "custom": {"name": "calc", "format": {
        "type": "grammar", "grammar": {"syntax": "lark", "definition": "start: /[0-9]+/"}}}}
    custom = post(api, "/tokenize", {"messages": msgs, "tools": [calc]}).json()
    prompt = post(api, "/detokenize", {"tokens": custom["tokens"]}).json()["prompt"]
    assert '"name": "calc"' in prompt and "Call calc with its input as it is" in prompt


@pytest.mark.parametrize("path,body,headers,status,param,code", [
    ("/tokenize", {"prompt": "x"}, {}, 401, None, "invalid_api_key"),
    ("/detokenize", {"tokens": [1]}, {"Authorization": "Bearer nope"}, 401, None, "invalid_api_key"),
    ("/tokenize", {"model": "other", "prompt": "x"}, AUTH, 404, "model", "model_not_found"),
    ("/tokenize", {"model": "other", "messages": CONVERSATIONS[0]}, AUTH, 404, "model",
     "model_not_found"),
    ("/detokenize", {"model": "other", "tokens": [1]}, AUTH, 404, "model", "model_not_found"),
    ("/tokenize", {}, AUTH, 400, "prompt", None),
    ("/tokenize", {"prompt": 5}, AUTH, 400, "prompt", None),
    ("/tokenize", {"messages": []}, AUTH, 400, "messages", None),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, AUTH, 400,
     "messages[0].role", None),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, AUTH,
     400, "messages[0].content", None),
    ("/tokenize", {"messages": CONVERSATIONS[0], "continue_final_message": True}, AUTH, 400,
     "continue_final_message", None),
    ("/tokenize", {"messages": CONVERSATIONS[0], "tools": [WEATHER, WEATHER]}, AUTH, 400,
     "tools", None),
    ("/tokenize", [1, 2], AUTH, 400, None, "invalid_json"),
    ("/detokenize", {"tokens": [1, 10**9]}, AUTH, 400, "tokens[1]", None),
    ("/detokenize", {"tokens": [-1]}, AUTH, 400, "tokens[0]", None),
    ("/detokenize", {"tokens": ["a"]}, AUTH, 400, "tokens[0]", None),
    ("/detokenize", {}, AUTH, 400, "tokens", None),
])
def test_errors_are_openai_shaped(api, path, body, headers, status, param, code):
    r = post(api, path, body, headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"]) == (param, code)


def test_body_that_is_not_json_is_400(api):
    r = api.post("/tokenize", content=b"{not json", headers={**AUTH,
                                                             "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


# ---- against the real server ------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    s = Server("--max-model-len", str(MAX_LEN), "--kv-cache-memory-gb", "0.5")
    yield s
    s.stop()


PREFILLED = [{"role": "user", "content": "Name a colour."},
             {"role": "assistant", "content": "My favourite colour is"}]


@pytest.mark.slow
def test_counts_equal_chat_usage(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    cases = [({"messages": m}, {}) for m in CONVERSATIONS] + [
        ({"messages": CONVERSATIONS[0], "tools": [WEATHER]}, {"tools": [WEATHER]}),
        ({"messages": CONVERSATIONS[0], "tools": [WEATHER], "tool_choice": "none"},
         {"tools": [WEATHER], "tool_choice": "none"}),
        # vLLM's chat fields, which the server used to ignore: no new assistant turn, and
        # the last (assistant) message continued
        ({"messages": CONVERSATIONS[0], "add_generation_prompt": False},
         {"extra_body": {"add_generation_prompt": False}}),
        ({"messages": PREFILLED, "add_generation_prompt": False, "continue_final_message": True},
         {"extra_body": {"add_generation_prompt": False, "continue_final_message": True}}),
        ({"messages": PREFILLED}, {})]
    counts = set()
    for tok_body, chat_extra in cases:
        r = httpx.post(f"{server.url}/tokenize", json={"model": model, **tok_body}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["max_model_len"] == MAX_LEN
        resp = client.chat.completions.create(model=model, messages=tok_body["messages"],
                                              max_tokens=1, temperature=0, **chat_extra)
        assert r.json()["count"] == resp.usage.prompt_tokens, tok_body
        counts.add(resp.usage.prompt_tokens)
    assert len(counts) >= 6          # the cases differ, so equal counts are not vacuous
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=PREFILLED, max_tokens=1,
                                       extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"


@pytest.mark.slow
def test_round_trip_and_refusals_on_the_server(server):
    text = "Grüße aus Köln 🚀\n  indented"
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, headers=AUTH).json()
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}, headers=AUTH)
    assert back.json() == {"prompt": text} and tok["count"] == len(tok["tokens"]) > 0
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": text}).status_code == 401
    r = httpx.post(f"{server.url}/detokenize", json={"model": "nope", "tokens": [1]}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.slow
def test_startup_logs_say_whether_cuda_graphs_are_used(server):
    import re
    import torch

    logs = server.logs()
    state = r"on \(decode batch sizes \d+-\d+\)" if torch.cuda.is_available() else "off"
    assert re.search(rf"engine ready: .* CUDA graphs {state}", logs), logs
    assert re.search(rf"serving .* \| CUDA graphs {state} \|", logs), logs


@pytest.mark.slow
def test_chat_template_flag_replaces_the_models(tiny_model_dir, tmp_path):
    """--chat-template FILE (vLLM's flag): chats are rendered with it, /tokenize and
    /v1/chat/completions alike; a template Jinja cannot parse stops the start."""
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    s = Server(str(tiny_model_dir), "--chat-template", str(template), "--dtype", "float32",
               "--kv-cache-memory-gb", "0.05", "--max-model-len", "256")
    try:
        msgs = [{"role": "user", "content": "Hi there"}]
        tok = httpx.post(f"{s.url}/tokenize", json={"messages": msgs}, headers=AUTH).json()
        text = httpx.post(f"{s.url}/detokenize", json={"tokens": tok["tokens"]}, headers=AUTH).json()
        assert text["prompt"] == "<user>Hi there\n<assistant>"
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key=KEY, max_retries=0)
        r = client.chat.completions.create(model=client.models.list().data[0].id, messages=msgs,
                                           max_tokens=1)
        assert r.usage.prompt_tokens == tok["count"]
    finally:
        s.stop()
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-P", "-m", "formwork", "serve", str(tiny_model_dir),
                           "--chat-template", "{% for m in messages %}"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--chat-template: not a valid Jinja template" in proc.stderr
