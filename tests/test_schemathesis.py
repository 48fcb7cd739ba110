"""Schemathesis against a real `formwork serve`: every operation of the published
OpenAPI document gets generated requests (valid ones, and invalid ones where the
schema allows negative cases); none may answer 5xx, every answer's status code
must be one the document lists and its body must match the documented schema.

The server runs the tiny random-weight model with a short context so that any
generated `max_tokens` finishes in milliseconds; the check is of the HTTP layer
(validation, errors, serialization), which is the same for every model.
"""
from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (response_schema_conformance,  # noqa: E402
                                               status_code_conformance)

from test_server import KEY, Server  # noqa: E402

pytestmark = pytest.mark.slow

# operations whose generated requests are worth the time: the generation paths and
# the small ones around them (metrics/health/docs carry no request body)
OPERATIONS = ("POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize",
              "POST /detokenize", "POST /v1/responses", "GET /v1/models", "POST /invocations")
EXAMPLES = 40


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    s = Server(str(tiny_model_dir), "--max-model-len", "64", "--max-num-seqs", "16",
               "--kv-cache-memory-gb", "0.05", "--dtype", "float32")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api(server):
    spec = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    return schemathesis.openapi.from_dict(spec)


@pytest.mark.parametrize("label", OPERATIONS)
def test_generated_requests_get_documented_answers_and_never_a_5xx(server, api, label):
    operation = api.find_operation_by_label(label)
    assert operation is not None, f"{label} is not in the published OpenAPI document"
    calls = []

    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def run(case):
        response = case.call_and_validate(
            base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
            checks=[not_a_server_error, status_code_conformance, response_schema_conformance])
        calls.append(response.status_code)

    run()
    # requests the document calls valid must get through at times: an operation
    # whose every generated request is refused documents a body it does not take
    assert 200 in calls, f"{label}: no generated request succeeded ({sorted(set(calls))})"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200   # still serving
