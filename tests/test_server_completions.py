"""/v1/completions beyond the basics, on the real server (fp32, so that logprobs can be
compared with HF transformers): echo + logprobs covers the prompt then the output,
max_tokens=0 scores a prompt, vLLM's prompt_logprobs field (completions and chat),
best_of > n returns the best candidates by cumulative logprob, and the refusals."""
from __future__ import annotations

import httpx
import pytest
import torch

from test_server import KEY, Server

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server():
    s = Server("--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-gb", "0.5")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hf(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    ids = tok(PROMPT, add_special_tokens=False).input_ids
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return tok, ids, ref


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", headers={"Authorization": f"Bearer {KEY}"},
                      json=body, timeout=300)


def completion(server, **body) -> dict:
    r = post(server, "completions", **body)
    assert r.status_code == 200, r.text
    return r.json()


def _check_prompt_part(lp: dict, tok, ids: list[int], ref: torch.Tensor, k: int) -> None:
    n = len(ids)
    assert lp["tokens"][:n] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, n):
        assert lp["token_logprobs"][p] == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-4)
        top = lp["top_logprobs"][p]      # the prompt token and the top-k
        assert tok.decode([ids[p]]) in top and k <= len(top) <= k + 1
        best = ref[p - 1].topk(k)
        for t, v in zip(best.indices.tolist(), best.values.tolist()):
            assert top[tok.decode([t])] == pytest.approx(v, abs=1e-4)
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in
                                   zip(offsets, offsets[1:], lp["tokens"]))


def test_echo_logprobs_cover_prompt_then_output(server, hf):
    tok, ids, ref = hf
    plain = completion(server, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    r = completion(server, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True)
    c, gen = r["choices"][0], plain["choices"][0]
    assert c["text"] == PROMPT + gen["text"]
    lp, n = c["logprobs"], len(ids)
    _check_prompt_part(lp, tok, ids, ref, 2)
    assert len(lp["tokens"]) == n + r["usage"]["completion_tokens"]
    assert lp["text_offset"][n] == len(PROMPT)
    assert lp["tokens"][n:] == gen["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == pytest.approx(gen["logprobs"]["token_logprobs"], abs=1e-4)
    assert [list(d) for d in lp["top_logprobs"][n:]] == [list(d) for d in gen["logprobs"]["top_logprobs"]]
    # echo + logprobs also fills vLLM's prompt_logprobs field
    plp = c["prompt_logprobs"]
    assert plp[0] is None and len(plp) == n
    assert plp[1][str(ids[1])]["logprob"] == pytest.approx(lp["token_logprobs"][1])
    # streamed: the same tokens and logprobs, prompt first
    chunks = _stream(server, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True)
    assert "".join(ch["text"] for ch in chunks) == c["text"]
    streamed = [t for ch in chunks if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]
    streamed_offsets = [o for ch in chunks if ch["logprobs"] for o in ch["logprobs"]["text_offset"]]
    assert streamed_offsets == lp["text_offset"]


def _stream(server, **body) -> list[dict]:
    import json
    out = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out += json.loads(line[6:])["choices"]
    return out


def test_max_tokens_zero_scores_the_prompt(server, hf):
    tok, ids, ref = hf
    r = completion(server, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    c = r["choices"][0]
    assert c["text"] == PROMPT and c["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 0 and len(c["logprobs"]["tokens"]) == len(ids)
    _check_prompt_part(c["logprobs"], tok, ids, ref, 1)
    r = completion(server, prompt=PROMPT, max_tokens=0, echo=True)   # echo alone
    assert r["choices"][0]["text"] == PROMPT and r["choices"][0]["logprobs"] is None
    assert r["choices"][0]["prompt_logprobs"] is None


def test_prompt_logprobs_field_on_both_endpoints(server, hf):
    tok, ids, ref = hf
    c = completion(server, prompt=PROMPT, max_tokens=1, prompt_logprobs=2)["choices"][0]
    assert c["logprobs"] is None and c["prompt_logprobs"][0] is None
    for p in range(1, len(ids)):
        d = c["prompt_logprobs"][p]
        e = d[str(ids[p])]
        assert e["logprob"] == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-4)
        assert e["rank"] == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        assert e["decoded_token"] == tok.decode([ids[p]])
        assert sorted(v["rank"] for v in d.values() if v["rank"] <= 2) == [1, 2]
    r = post(server, "chat/completions", messages=[{"role": "user", "content": "Hi"}],
             max_tokens=2, prompt_logprobs=0)
    assert r.status_code == 200, r.text
    chat = r.json()
    plp = chat["prompt_logprobs"]
    assert plp[0] is None and len(plp) == chat["usage"]["prompt_tokens"]
    assert all(len(d) == 1 and next(iter(d.values()))["logprob"] <= 0 for d in plp[1:])


def test_best_of_returns_top_n_by_cumulative_logprob(server):
    body = dict(prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=1234)
    every = completion(server, n=4, logprobs=0, **body)
    cum = [(sum(c["logprobs"]["token_logprobs"]), c["text"]) for c in every["choices"]]
    assert len({t for _, t in cum}) > 2, "candidates should differ"
    want = [t for _, t in sorted(cum, reverse=True)[:2]]
    best = completion(server, n=2, best_of=4, **body)
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert [c["text"] for c in best["choices"]] == want
    assert all(c["logprobs"] is None for c in best["choices"])      # not asked for
    assert best["usage"]["completion_tokens"] == every["usage"]["completion_tokens"]
    with_lp = completion(server, n=1, best_of=4, logprobs=1, **body)["choices"][0]
    assert with_lp["text"] == want[0] and len(with_lp["logprobs"]["top_logprobs"][0]) == 1


@pytest.mark.parametrize("body,param", [
    (dict(n=3, best_of=2), "best_of"),
    (dict(best_of=2, stream=True), "best_of"),
    (dict(prompt_logprobs=1, stream=True), "prompt_logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(max_tokens=0), "max_tokens"),
])
def test_refusals(server, body, param):
    r = post(server, "completions", prompt=PROMPT, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
