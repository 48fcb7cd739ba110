"""A tokenizer that adds a BOS (Llama-3, Mistral): text prompts of /v1/completions and
of the offline `LLM.generate` get it, as vLLM's and transformers' defaults do, unless
`add_special_tokens` is false; token-id prompts are taken as they are; chat prompts
(whose template writes its own special tokens) get none unless asked; /tokenize counts
what the completion is charged."""
from __future__ import annotations

import shutil

import httpx
import pytest

from test_server import KEY, Server

BOS = 0      # <|endoftext|> in the default model's vocabulary
H = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def bos_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a tokenizer whose post-processor prepends <|endoftext|>."""
    from tokenizers import Tokenizer, processors

    out = tmp_path_factory.mktemp("tiny-bos")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, out / f.name)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B",
        special_tokens=[("<|endoftext|>", BOS)])
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def plain_ids(bos_model_dir):
    from formwork.gpu.model_files import load_tokenizer

    tok = load_tokenizer(bos_model_dir)
    assert tok("Hi there").input_ids[0] == BOS          # the fixture does what it says
    return lambda text: tok(text, add_special_tokens=False).input_ids


def test_offline_generate_adds_the_tokenizers_bos(bos_model_dir, plain_ids):
    from formwork import LLM, SamplingParams

    llm = LLM(str(bos_model_dir), engine_process=False, dtype="float32", num_kv_blocks=32,
              block_size=8)
    try:
        sp = SamplingParams(max_tokens=2, temperature=0)
        out = llm.generate(["Hi there", {"prompt_token_ids": plain_ids("Hi there")}], sp)
        assert out[0].prompt_token_ids == [BOS, *plain_ids("Hi there")]
        assert out[1].prompt_token_ids == plain_ids("Hi there")
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def bos_server(bos_model_dir):
    s = Server(str(bos_model_dir), "--dtype", "float32", "--max-model-len", "256",
               "--kv-cache-memory-gb", "0.05")
    yield s
    s.stop()


def _post(server, path, **body):
    r = httpx.post(f"{server.url}{path}", json={"max_tokens": 2, "temperature": 0,
                                                "return_token_ids": True, **body},
                   headers=H, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_add_the_bos_as_vllm(bos_server, plain_ids):
    ids = plain_ids("The capital of France is")
    r = _post(bos_server, "/v1/completions", prompt="The capital of France is")
    assert r["choices"][0]["prompt_token_ids"] == [BOS, *ids]
    assert r["usage"]["prompt_tokens"] == len(ids) + 1
    counted = httpx.post(f"{bos_server.url}/tokenize", headers=H, timeout=60,
                         json={"prompt": "The capital of France is"}).json()
    assert counted["count"] == r["usage"]["prompt_tokens"]
    off = _post(bos_server, "/v1/completions", prompt="The capital of France is",
                add_special_tokens=False)
    assert off["choices"][0]["prompt_token_ids"] == ids
    nulled = _post(bos_server, "/v1/completions", prompt="The capital of France is",
                   add_special_tokens=None)                 # null: the default
    assert nulled["choices"][0]["prompt_token_ids"] == [BOS, *ids]
    as_ids = _post(bos_server, "/v1/completions", prompt=ids)
    assert as_ids["choices"][0]["prompt_token_ids"] == ids


def test_chat_leaves_special_tokens_to_the_template(bos_server):
    msgs = [{"role": "user", "content": "Hi"}]
    r = _post(bos_server, "/v1/chat/completions", messages=msgs)
    assert r["prompt_token_ids"][0] != BOS
    nulled = _post(bos_server, "/v1/chat/completions", messages=msgs, add_special_tokens=None,
                   include_reasoning=None)
    assert nulled["prompt_token_ids"] == r["prompt_token_ids"]
    asked = _post(bos_server, "/v1/chat/completions", messages=msgs, add_special_tokens=True)
    assert asked["prompt_token_ids"] == [BOS, *r["prompt_token_ids"]]
