"""`formwork serve` under vLLM's HTTP and request flags, against real servers (the
tiny model): CORS (vLLM's default: any origin; preflights answered before the key
check), TLS, --root-path, --return-tokens-as-token-ids, --max-logprobs,
--trust-request-chat-template, --enable-log-requests / --max-log-len, and the
generation config as sampling defaults (--generation-config,
--override-generation-config); bad values stop the start naming the flag."""
from __future__ import annotations

import datetime
import json

import httpx
import pytest

from formwork.gateway.serve_options import generation_defaults
from test_server import KEY, Server

BASE = ("--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory-gb", "0.05")
H = {"Authorization": f"Bearer {KEY}"}


def _chat(server, verify=True, **kw):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, **kw}
    body = {k: v for k, v in body.items() if v is not None}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=H, timeout=60,
                      verify=verify)


@pytest.fixture(scope="module")
def flags_server(tiny_model_dir):
    s = Server(str(tiny_model_dir), *BASE, "--max-model-len", "512", "--tool-call-parser",
               "llama3_json", "--return-tokens-as-token-ids", "--max-logprobs", "3",
               "--trust-request-chat-template", "--enable-log-requests", "--max-log-len", "12",
               "--override-generation-config", '{"temperature": 0, "max_new_tokens": 5}',
               "--allowed-origins", '["https://app.example"]', "--root-path", "/llm",
               "--disable-uvicorn-access-log", "--async-scheduling",
               "--enable-prompt-tokens-details", "--response-role", "assistant")
    yield s
    s.stop()


def test_cors_preflight_and_origin(flags_server):
    pre = httpx.options(f"{flags_server.url}/v1/chat/completions", timeout=30, headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200, pre.text          # answered before the key check
    assert pre.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.get(f"{flags_server.url}/v1/models", headers={**H, "Origin": "https://app.example"},
                  timeout=30)
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.get(f"{flags_server.url}/v1/models", headers={**H, "Origin": "https://evil.example"},
                      timeout=30)
    assert "access-control-allow-origin" not in other.headers


def test_request_defaults_and_caps(flags_server):
    # the overridden generation config: greedy and 5 tokens unless a request says otherwise
    a, b = _chat(flags_server, max_tokens=None).json(), _chat(flags_server, max_tokens=None).json()
    assert a["usage"]["completion_tokens"] == 5 and a["choices"][0]["finish_reason"] == "length"
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert _chat(flags_server, max_tokens=7, ignore_eos=True).json()["usage"]["completion_tokens"] == 7
    # server-wide token ids in logprobs; the cap on top_logprobs
    r = _chat(flags_server, logprobs=True, top_logprobs=3).json()
    assert all(t["token"].startswith("token_id:") for t in r["choices"][0]["logprobs"]["content"])
    over = _chat(flags_server, logprobs=True, top_logprobs=4)
    assert over.status_code == 400 and over.json()["error"]["param"] == "top_logprobs"
    assert "--max-logprobs" in over.json()["error"]["message"]
    c = httpx.post(f"{flags_server.url}/v1/completions", headers=H, timeout=60,
                   json={"prompt": "a", "max_tokens": 2, "logprobs": 5})
    assert c.status_code == 400 and c.json()["error"]["param"] == "logprobs"


def test_request_chat_template_when_trusted(flags_server, tiny_model_dir):
    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    r = httpx.post(f"{flags_server.url}/tokenize", headers=H, timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}]}).json()
    own = _chat(flags_server, chat_template=template, max_tokens=1)
    assert own.status_code == 200, own.text
    assert own.json()["usage"]["prompt_tokens"] != r["count"]      # the request's template
    bad = _chat(flags_server, chat_template="{% for %}")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"
    # reasoning_effort reaches the template (chat_template_kwargs' own value wins)
    effort = template + "{% if reasoning_effort == 'high' %} think long and hard{% endif %}"

    def prompt_tokens(**kw):
        r = _chat(flags_server, chat_template=effort, max_tokens=1, **kw)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    low = prompt_tokens(reasoning_effort="low")
    assert low == prompt_tokens() == own.json()["usage"]["prompt_tokens"]
    assert prompt_tokens(reasoning_effort="high") > low
    assert prompt_tokens(reasoning_effort="high",
                         chat_template_kwargs={"reasoning_effort": "low"}) == low
    # /tokenize renders the same prompt (the request's template, its effort)
    tok = httpx.post(f"{flags_server.url}/tokenize", headers=H, timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "chat_template": effort,
        "reasoning_effort": "high"}).json()
    assert tok["count"] == prompt_tokens(reasoning_effort="high")
    assert prompt_tokens(reasoning_effort="xhigh") == low     # OpenAI's newest level
    assert prompt_tokens(reasoning_effort="max") == low       # vLLM's (DeepSeek V4)
    wrong = _chat(flags_server, reasoning_effort="maximum")
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "reasoning_effort"


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {"name": "weather", "parameters": CITY}},
           {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}}]


def test_llama3_json_tools_prompt(flags_server):
    """--tool-call-parser llama3_json: the tools prompt of a template without tools
    teaches Llama 3's JSON calls (tests/test_tool_formats.py: the constraint and the
    parse under it), in chat completions and /tokenize alike."""
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = httpx.post(f"{flags_server.url}/tokenize", headers=H, timeout=30, json={
        "messages": ask, "tools": WEATHER}).json()
    prompt = httpx.post(f"{flags_server.url}/detokenize", headers=H, timeout=30,
                        json={"tokens": r["tokens"]}).json()["prompt"]
    assert '{"name": <function-name>, "parameters": <args-json-object>}' in prompt
    assert "<tool_call>" not in prompt
    chat = _chat(flags_server, messages=ask, tools=WEATHER, max_tokens=1)
    assert chat.json()["usage"]["prompt_tokens"] == r["count"]


def test_requests_are_logged_cut(flags_server):
    _chat(flags_server, messages=[{"role": "user", "content": "LOGGED-PROMPT-" + "x" * 50}])
    logs = flags_server.logs()
    line = [ln for ln in logs.splitlines() if "request chatcmpl-" in ln and "params" in ln][-1]
    start = line.index("prompt ") + len("prompt ")
    assert len(eval(line[start:line.index(", params")])) == 12     # --max-log-len
    assert "GET /v1/models" not in logs and "POST /v1/chat" not in logs   # no access log


def test_root_path_is_the_apps(flags_server):
    spec = httpx.get(f"{flags_server.url}/openapi.json", timeout=30).json()
    assert spec.get("servers") == [{"url": "/llm"}]


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(1)
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(
                ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return tmp_path / "key.pem", tmp_path / "cert.pem"


class TLSServer(Server):
    """Server over https (its health poll included)."""

    def __init__(self, *args, **kw):
        import test_server
        real = test_server.httpx.get
        test_server.httpx.get = lambda url, **k: real(url.replace("http://", "https://"),
                                                      verify=False, **k)
        try:
            super().__init__(*args, **kw)
        finally:
            test_server.httpx.get = real
        self.url = self.url.replace("http://", "https://")


@pytest.mark.parametrize("flags,words", [
    (["--max-logprobs", "30"], "--max-logprobs"),
    (["--ssl-keyfile", "/nonexistent.pem", "--ssl-certfile", "/nonexistent.pem"], "--ssl-keyfile"),
    (["--ssl-certfile", __file__], "go together"),
    (["--override-generation-config", '{"seed": 3}'], "--override-generation-config"),
    (["--generation-config", "/nonexistent"], "--generation-config"),
    (["--allowed-origins", "*"], "--allowed-origins"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size"),
])
def test_bad_flags_stop_the_start(tiny_model_dir, flags, words, capsys):
    """Exit 2 naming the flag, before any engine starts (in-process: the CLI's main)."""
    from formwork.gateway.cli import main
    try:
        code = main(["serve", str(tiny_model_dir), *flags])
    except SystemExit as e:           # argparse's own refusals
        code = e.code
    assert code == 2
    assert words in capsys.readouterr().err


def test_generation_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 64, "do_sample": True,
         "eos_token_id": [1, 2]}))
    assert generation_defaults("auto", str(tmp_path), None) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}
    assert generation_defaults("vllm", str(tmp_path), {"temperature": 0.1}) == {"temperature": 0.1}
    assert generation_defaults("auto", str(tmp_path / "none"), None) == {}
    assert generation_defaults(str(tmp_path), None, {"top_k": 5})["top_k"] == 5


@pytest.fixture(scope="module")
def ends(tiny_model_dir, tmp_path_factory):
    """A copy of the tiny model whose generation config lists a second end id: one
    that seeded sampling writes a few tokens in (folder, its position k, the id, the
    tokens written without it)."""
    import shutil

    from formwork import LLM, SamplingParams

    folder = tmp_path_factory.mktemp("ends") / "model"
    shutil.copytree(tiny_model_dir, folder)
    llm = LLM(str(folder), engine_process=False, dtype="float32", num_kv_blocks=32)
    try:
        free = llm.generate(PROMPT, SamplingParams(**SEEDED), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    k = next(i for i, t in enumerate(free) if i and t not in free[:i])   # a new token
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, free[k]]}))
    return folder, k, free[k], free


PROMPT = [{"prompt_token_ids": [1000, 2000, 3000, 4000, 5000]}]
SEEDED = dict(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)     # varied tokens


def test_generation_config_end_ids_stop_offline_requests(ends):
    """The generation config's end ids beside the tokenizer's (Qwen's <|endoftext|>,
    Llama 3's <|eom_id|>) stop generation as vLLM stops it; ignore_eos keeps going."""
    from formwork import LLM, SamplingParams

    folder, k, end, free = ends
    llm = LLM(str(folder), engine_process=False, dtype="float32", num_kv_blocks=32)
    try:
        seeded = SamplingParams(**SEEDED)
        out = llm.generate(PROMPT, seeded.clone(ignore_eos=False), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == free[:k + 1] and out.finish_reason == "stop"
        assert out.stop_reason == end
        assert llm.generate(PROMPT, seeded, use_tqdm=False)[0].outputs[0].token_ids == free
    finally:
        llm.shutdown()


def test_tls_and_served_end_ids(ends, tmp_path):
    """https with --ssl-keyfile / --ssl-certfile (plain http gets no answer); the
    served model stops at its generation config's second end id too."""
    folder, k, end, _ = ends
    key, cert = _self_signed(tmp_path)
    s = TLSServer(str(folder), *BASE, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert))
    try:
        r = _chat(s, verify=str(cert))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        with pytest.raises(httpx.TransportError):       # plain http: no answer
            httpx.get(s.url.replace("https://", "http://") + "/health", timeout=5)
        r = httpx.post(f"{s.url}/v1/completions", headers=H, timeout=60, verify=str(cert), json={
            "prompt": PROMPT[0]["prompt_token_ids"], "max_tokens": 8, "temperature": 1.0,
            "seed": 7}).json()
        assert r["usage"]["completion_tokens"] == k + 1 and r["choices"][0]["stop_reason"] == end
    finally:
        s.stop()


# ---- vLLM's config file, structured-outputs config and request-level flags ---------------

TEMPLATE = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
            "{% if extra_word %} EXTRA WORDS HERE{% endif %}")


@pytest.fixture(scope="module")
def yaml_server(tiny_model_dir, tmp_path_factory):
    """`formwork serve --config FILE` (vLLM's YAML of flags) with more flags after it,
    vLLM's dotted --structured-outputs-config.KEY among them."""
    folder = tmp_path_factory.mktemp("yaml-config")
    (folder / "serve.yaml").write_text(
        "dtype: float32\nkv-cache-memory-gb: 0.05\nmax-model-len: 0.5K\n"
        "max_num_batched_tokens: 1k\n"
        "enable-request-id-headers: true\nenable-force-include-usage: true\n"
        "disable-fastapi-docs: true\nenable-prefix-caching: false\n"
        f"chat-template: {json.dumps(TEMPLATE)}\n"
        "default-chat-template-kwargs: {extra_word: true}\n"
        "structured-outputs-config: {backend: llguidance}\n")
    s = Server(str(tiny_model_dir), "--config", str(folder / "serve.yaml"),
               "--structured-outputs-config.disable_any_whitespace", "true",
               "--no-enable-chunked-prefill", env={"VLLM_SERVER_DEV_MODE": "1"})
    yield s
    s.stop()


def test_yaml_config_and_request_flags(yaml_server):
    models = httpx.get(f"{yaml_server.url}/v1/models", headers=H, timeout=30)
    assert models.json()["data"][0]["max_model_len"] == 512            # 0.5K
    assert models.headers["x-request-id"]                               # a new id
    own = httpx.get(f"{yaml_server.url}/v1/models", timeout=30,
                    headers={**H, "X-Request-Id": "trace-42"})
    assert own.headers["x-request-id"] == "trace-42"
    refused = httpx.get(f"{yaml_server.url}/v1/models", timeout=30, headers={"X-Request-Id": "r1"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "r1"
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{yaml_server.url}{path}", timeout=30).status_code == 404
    for method in ("GET", "POST"):                      # vLLM's /ping is /health
        ping = httpx.request(method, f"{yaml_server.url}/ping", timeout=30)
        assert ping.status_code == 200 and ping.json()["status"] == "ready"
    # --enable-force-include-usage: a stream ends with usage unasked
    r = httpx.post(f"{yaml_server.url}/v1/chat/completions", headers=H, timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True})
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] <= 3


def test_default_chat_template_kwargs_under_the_requests(yaml_server):
    def count(**kw):
        return httpx.post(f"{yaml_server.url}/tokenize", headers=H, timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], **kw}).json()["count"]

    with_words = count()
    assert count(chat_template_kwargs={"extra_word": False}) < with_words
    r = httpx.post(f"{yaml_server.url}/v1/chat/completions", headers=H, timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).json()
    assert r["usage"]["prompt_tokens"] == with_words


def test_server_wide_compact_json(yaml_server):
    """--structured-outputs-config disable_any_whitespace: JSON constraints get no
    optional whitespace unless the request asks for its own."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"},
                                               "c": {"type": "array", "items": {"enum": [1, 2]}}},
              "required": ["a", "b", "c"], "additionalProperties": False}
    for seed in range(3):
        r = _chat(yaml_server, max_tokens=60, temperature=1.0, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).json()
        text = r["choices"][0]["message"]["content"]
        if r["choices"][0]["finish_reason"] == "stop":
            assert text == json.dumps(json.loads(text), separators=(",", ":")), text
        assert not any(ch in text for ch in " \n\t"), text
    flexible = [_chat(yaml_server, max_tokens=60, temperature=1.0, seed=seed, structured_outputs={
        "json": schema, "whitespace": "flexible"}).json()
        ["choices"][0]["message"]["content"] for seed in range(6)]
    assert any(ch in text for text in flexible for ch in " \n\t"), flexible


def _parsed(argv):
    from formwork.gateway.cli import apply_vllm_arguments, build_parser, expand_vllm_argv
    argv = expand_vllm_argv(argv)
    args = build_parser(argv).parse_args(argv)
    apply_vllm_arguments(args)
    return args


def test_structured_outputs_config_spellings(tmp_path):
    args = _parsed(["serve", "--structured-outputs-config", '{"backend": "xgrammar"}',
                    "--structured-outputs-config.disable-any-whitespace=true",
                    "--structured-outputs-config.reasoning_parser", "qwen3"])
    assert (args.structured_backend, args.structured_whitespace, args.reasoning_parser) == \
        ("xgrammar", "compact", "qwen3")
    assert _parsed(["serve", "--structured-outputs-config.backend", "guidance"]) \
        .structured_backend == "guidance"
    for bad, words in ((["--structured-outputs-config.backend", "lm-format-enforcer"], "backend"),
                       (['--structured-outputs-config', '{"enable_in_reasoning": true}'],
                        "enable_in_reasoning"),
                       (['--structured-outputs-config', '{"whitespace": 1}'], "unknown key"),
                       (["--structured-outputs-config.disable_fallback", "maybe"], "true or false"),
                       (["--reasoning-parser", "deepseek_r1",
                         "--structured-outputs-config.reasoning_parser", "qwen3"], "contradicts")):
        with pytest.raises(ValueError, match=words):
            _parsed(["serve", *bad])
    (tmp_path / "c.yaml").write_text("port: 9001\nserved_model_name: [a, b]\ntrust-remote-code: true\n"
                                     "max-model-len: 4k\n")
    args = _parsed(["serve", "--config", str(tmp_path / "c.yaml"), "--port", "9002"])
    assert (args.port, args.served_model_name, args.max_model_len) == (9002, ["a", "b"], 4000)
    (tmp_path / "list.yaml").write_text("- port\n")
    with pytest.raises(ValueError, match="mapping"):
        _parsed(["serve", "--config", str(tmp_path / "list.yaml")])


def test_vllm_flags_with_nothing_to_do_are_taken_or_refused_by_value():
    args = _parsed(["serve", "--download-dir", "/tmp", "--tokenizer-mode", "auto",
                    "--api-server-count", "1", "--cpu-offload-gb", "0", "-O0",
                    "--compilation-config", '{"level": 3}'])
    assert args.api_server_count == 1
    for bad in (["--api-server-count", "2"], ["--tokenizer-mode", "mistral"],
                ["--cpu-offload-gb", "4"]):
        with pytest.raises(SystemExit):
            _parsed(["serve", *bad])


def test_sagemaker_invocations_answer_as_the_openai_routes(yaml_server):
    """SageMaker posts every inference to /invocations (vLLM reads `messages` as a chat
    completion, `prompt` as a completion): the same answers, streams, 400s and key."""
    url = f"{yaml_server.url}/invocations"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    direct = httpx.post(f"{yaml_server.url}/v1/chat/completions", headers=H, timeout=60,
                        json=chat).json()
    r = httpx.post(url, headers=H, timeout=60, json=chat)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    assert r.json()["choices"][0]["message"] == direct["choices"][0]["message"]
    done = httpx.post(url, headers=H, timeout=60, json={"prompt": "1, 2, 3,", "max_tokens": 3,
                                                          "temperature": 0})
    assert done.status_code == 200 and done.json()["object"] == "text_completion"
    streamed = httpx.post(url, headers=H, timeout=60, json={**chat, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = [json.loads(x[6:]) for x in streamed.text.splitlines() if x.startswith("data: {")]
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"]) == direct["choices"][0]["message"]["content"]
    for body, param in (({"input": "hi"}, "messages"), ({"messages": "hi"}, "messages"),
                        ({"prompt": "x", "max_tokens": -5}, "max_tokens")):
        bad = httpx.post(url, headers=H, timeout=60, json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    assert httpx.post(url, timeout=60, json=chat).status_code == 401


def test_load_and_reset_prefix_cache(yaml_server, flags_server):
    """vLLM's /load (generation requests in flight) and /reset_prefix_cache, which is
    served in development mode only (VLLM_SERVER_DEV_MODE=1, as vLLM): after the
    reset a repeated prompt finds nothing cached."""
    assert httpx.post(f"{flags_server.url}/reset_prefix_cache", headers=H,
                      timeout=30).status_code == 404
    load = httpx.get(f"{yaml_server.url}/load", timeout=30)
    assert load.status_code == 200 and load.json() == {"server_load": 0}
    body = {"prompt": "The quick brown fox jumps over the lazy dog. " * 12, "max_tokens": 1}

    def cached() -> int:
        r = httpx.post(f"{yaml_server.url}/v1/completions", headers=H, timeout=60, json=body)
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0
    assert httpx.post(f"{yaml_server.url}/reset_prefix_cache", timeout=30).status_code == 401
    reset = httpx.post(f"{yaml_server.url}/reset_prefix_cache", headers=H, timeout=30)
    assert reset.status_code == 200 and reset.json() == {"reset": True}
    assert cached() == 0


def test_a_reset_while_a_request_runs_is_refused_and_load_counts_it(yaml_server):
    body = {"prompt": "a", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{yaml_server.url}/v1/completions", headers=H, json=body,
                      timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        assert httpx.get(f"{yaml_server.url}/load", timeout=30).json() == {"server_load": 1}
        busy = httpx.post(f"{yaml_server.url}/reset_prefix_cache", headers=H, timeout=30)
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "engine_busy"
        assert [line for line in lines if line][-1] == "data: [DONE]"
    assert httpx.get(f"{yaml_server.url}/load", timeout=30).json() == {"server_load": 0}
    assert httpx.post(f"{yaml_server.url}/reset_prefix_cache", headers=H,
                      timeout=30).json() == {"reset": True}
