"""What the published OpenAPI document says about request bodies FastAPI cannot
infer: POST /tokenize and POST /invocations take `body: dict` (gateway/serving_tokenize.py
and gateway/routes.py pick the completion or the chat shape themselves, for clearer
errors than a union's), so their bodies are documented here as either model. Schemathesis (tests/test_schemathesis.py)
holds the document to what the server accepts.
"""
from __future__ import annotations

from pydantic.json_schema import models_json_schema

from formwork.schemas.openai import ChatCompletionRequest, CompletionRequest
from formwork.schemas.openai_tokenize import TokenizeChatRequest, TokenizeCompletionRequest

UNION_BODIES = {("/tokenize", "post"): (TokenizeCompletionRequest, TokenizeChatRequest),
                ("/invocations", "post"): (ChatCompletionRequest, CompletionRequest)}


def document_request_bodies(schema: dict) -> None:
    """Set (in place) the request body of each UNION_BODIES operation to anyOf its models."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for (path, method), models in UNION_BODIES.items():
        operation = schema.get("paths", {}).get(path, {}).get(method)
        if operation is None:
            continue
        refs, defs = models_json_schema([(m, "validation") for m in models],
                                        ref_template="#/components/schemas/{model}")
        components.update(defs.get("$defs", {}))
        operation["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"anyOf": [refs[(m, "validation")] for m in models]}}}}
