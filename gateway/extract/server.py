"""`formwork extract --server URL`: the documents go, at most --concurrency at a
time, to a running `formwork serve` or any OpenAI-compatible server, and each
record is emitted as its document completes.

Long documents are handled as offline (prompt.py `fitted_prompt`): the
prompt is measured with the server's POST /tokenize in its messages form (so the
chat template counts) against the max_model_len it reports, and a document that
does not leave room for --max-tokens is cut (tokens through /tokenize, the
prefix back through /detokenize) or skipped (--on-long). These are vLLM's
endpoints; `formwork serve` has them too. A server without them (404) gets every
document whole, as a plain OpenAI endpoint would, and one warning says so.
"""
from __future__ import annotations

import asyncio
import sys
import time
import urllib.parse

import httpx

from formwork.gateway.extract.inputs import Document, UsageError
from formwork.gateway.extract.prompt import ExtractOptions, build_messages, fitted_prompt, warn
from formwork.gateway.extract.records import judge, make_record, make_validator

NO_ROUTE = (404, 405, 501)


class MeasureError(Exception):
    """A /tokenize or /detokenize call failed; `status` is the HTTP status, if any."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class ServerMeter:
    """TokenMeter (prompt.py) over the server's /tokenize and /detokenize.
    Blocking; called from worker threads (httpx.Client is thread-safe). Every
    /tokenize answer refreshes `max_model_len`."""

    def __init__(self, http: httpx.Client, root: str, model: str) -> None:
        self.http, self.root, self.model = http, root.rstrip("/"), model
        self.max_model_len: int | None = None

    def _post(self, path: str, body: dict) -> dict:
        try:
            r = self.http.post(self.root + path, json={"model": self.model, **body})
        except httpx.HTTPError as e:
            raise MeasureError(f"{path}: {type(e).__name__}: {e}") from None
        try:
            data = r.json()
        except ValueError:
            data = {}
        if r.status_code != 200:
            data = data if isinstance(data, dict) else {}
            err = data["error"] if isinstance(data.get("error"), dict) else data  # older vLLM: flat
            message = err.get("message") or r.reason_phrase
            raise MeasureError(f"server error {r.status_code} on {path}: {message}",
                               r.status_code, err.get("code"))
        return data

    def count(self, messages: list[dict]) -> int:
        data = self._post("/tokenize", {"messages": messages, "add_generation_prompt": True})
        self.max_model_len = int(data["max_model_len"])
        return int(data["count"])

    def encode(self, text: str) -> list[int]:
        return list(self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"])

    def decode(self, ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": ids})["prompt"]


def api_base(url: str) -> str:
    """A bare http://host:port gets the /v1 prefix; any other path is kept."""
    return url.rstrip("/") + "/v1" if urllib.parse.urlsplit(url).path in ("", "/") else url


def server_root(url: str) -> str:
    """Where /tokenize lives: the API base without its trailing /v1."""
    base = api_base(url).rstrip("/")
    return base.removesuffix("/v1")


async def usable_meter(meter: ServerMeter, opts: ExtractOptions) -> ServerMeter | None:
    """`meter` once one /tokenize call worked, else None after one warning (documents
    are then sent whole). UsageError when --max-tokens leaves no room at all."""
    try:
        await asyncio.to_thread(meter.count, build_messages("", opts))
    except MeasureError as e:
        if e.status in NO_ROUTE and e.code != "model_not_found":
            warn("the server has no /tokenize: documents are sent whole, --on-long does not "
                 "apply, and one longer than the server's context fails")
        else:
            warn(f"cannot measure prompts ({e}): documents are sent whole and --on-long "
                 "does not apply")
        return None
    if opts.max_tokens >= meter.max_model_len:
        raise UsageError(f"--max-tokens {opts.max_tokens} leaves no room for a prompt: the "
                         f"server's max_model_len is {meter.max_model_len}")
    return meter


async def server_prompt(doc: Document, opts: ExtractOptions,
                        meter: ServerMeter | None) -> tuple[list[dict], bool] | dict:
    """(messages, truncated), or the record of a document that is not sent."""
    if meter is None:
        return build_messages(doc.text, opts), False
    try:
        return await asyncio.to_thread(fitted_prompt, doc, opts, meter, meter.max_model_len)
    except MeasureError as e:
        return make_record(doc, error=f"cannot measure the prompt: {e}")


def response_format(schema: dict) -> dict:
    name = "".join(c if c.isalnum() or c in "_-" else "_" for c in str(schema.get("title", "")))
    return {"type": "json_schema",
            "json_schema": {"name": name[:64] or "extraction", "schema": schema, "strict": True}}


async def extract_server(docs: list[Document], opts: ExtractOptions, emit, *, base_url: str,
                         api_key: str | None = None, model: str | None = None,
                         concurrency: int = 16, timeout_s: float = 600.0,
                         progress: bool = True) -> None:
    """Sends `docs` to an OpenAI-compatible server, at most `concurrency` at a
    time, and calls `emit(record)` as each one completes."""
    import openai

    validator, fmt = make_validator(opts.schema, opts.model), response_format(opts.schema)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with openai.AsyncOpenAI(base_url=api_base(base_url), api_key=api_key or "EMPTY",
                                  timeout=timeout_s) as client:
        if model is None:
            model = await _first_model(client, base_url)
        with httpx.Client(headers=headers, timeout=timeout_s) as http:
            meter = await usable_meter(ServerMeter(http, server_root(base_url), model), opts)
            gate = asyncio.Semaphore(concurrency)

            async def one(doc: Document) -> dict:
                if doc.error:
                    return make_record(doc, error=doc.error)
                async with gate:
                    prompt = await server_prompt(doc, opts, meter)
                    if isinstance(prompt, dict):
                        return prompt
                    try:
                        resp = await client.chat.completions.create(
                            model=model, messages=prompt[0], response_format=fmt,
                            temperature=opts.temperature, max_tokens=opts.max_tokens)
                    except openai.APIError as e:
                        return make_record(doc, error=_server_error(e), truncated=prompt[1])
                choice, u = resp.choices[0], resp.usage
                return judge(doc, choice.message.content or "", choice.finish_reason, validator,
                             usage=(u.prompt_tokens, u.completion_tokens) if u else (0, 0),
                             truncated=prompt[1])

            await _run_all(docs, one, emit, progress)


async def _run_all(docs: list[Document], one, emit, progress: bool) -> None:
    from tqdm.auto import tqdm

    with tqdm(total=len(docs), unit="doc", desc="extract", disable=not progress,
              file=sys.stderr, dynamic_ncols=True) as bar:
        t0, tokens = time.perf_counter(), 0
        for done in asyncio.as_completed([one(d) for d in docs]):
            rec = await done
            emit(rec)
            tokens += rec["usage"]["completion_tokens"]
            bar.update(1)
            bar.set_postfix_str(f"{tokens / (time.perf_counter() - t0):.1f} tok/s")


def _server_error(e) -> str:
    """'server error 400: <the server's message>' from an openai.APIError."""
    code = getattr(e, "status_code", None)
    body = e.body if isinstance(e.body, dict) else {}
    return f"server error{f' {code}' if code else ''}: {body.get('message') or e.message}"


async def _first_model(client, url: str) -> str:
    import openai
    try:
        models = (await client.models.list()).data
    except openai.APIError as e:
        raise UsageError(f"--server {url}: cannot list its models ({_server_error(e)}); is it up? "
                         "(or name the model with --server-model)") from None
    if not models:
        raise UsageError(f"--server {url}: serves no models; name one with --server-model")
    return models[0].id
