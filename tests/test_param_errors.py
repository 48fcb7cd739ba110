"""A refused value's field travels as data (ParamError.param ->
EngineCoreOutput.error_param -> the client's error.param), not parsed back from
the message on the gateway's side of the process boundary."""
from __future__ import annotations

import msgspec
import pytest
import zmq

from formwork.core.engine_proc import EngineLoop
from formwork.core.prompt_check import check_prompt
from formwork.gateway.engine_client import EngineRequestError
from formwork.gateway.errors import from_value_error
from formwork.schemas.engine import EngineCoreOutputs, EngineCoreRequest, FinishReason
from formwork.schemas.errors import ParamError, param_of
from formwork.schemas.sampling import SamplingParams


def test_param_error_is_a_value_error_with_its_field():
    e = ParamError("structured_outputs.json", "a JSON Schema must be an object")
    assert isinstance(e, ValueError) and e.param == "structured_outputs.json"
    assert str(e) == "structured_outputs.json: a JSON Schema must be an object"
    assert param_of(e) == "structured_outputs.json"
    assert param_of(ValueError("temperature: must be >= 0")) == "temperature"   # untyped
    assert param_of(ValueError("no field named here")) is None
    assert param_of(ParamError(None, "the body as a whole")) is None


def test_checks_raise_param_errors():
    with pytest.raises(ParamError) as e:
        check_prompt([], 16, 100)
    assert e.value.param == "prompt"
    with pytest.raises(ParamError) as e:
        SamplingParams(temperature=-1.0)
    assert e.value.param == "temperature"
    # the gateway's mapping takes the field from the exception, even when the text
    # would say otherwise
    assert from_value_error(ParamError("top_p", "x: y")).param == "top_p"


class _Refusing:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def add_request(self, req) -> None:
        raise self.exc


@pytest.mark.parametrize("exc, param", [
    (ParamError("logit_bias", "token id 99 outside the vocabulary"), "logit_bias"),
    (ValueError("structured_outputs.json: minLength 5 > maxLength 2 at /a"), "structured_outputs.json"),
    (ValueError("refused without a field"), None),
])
def test_an_engine_refusal_carries_its_field_across_the_boundary(exc, param):
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull.bind("inproc://out")
    push.connect("inproc://out")
    try:
        loop = EngineLoop(_Refusing(exc), ctx.socket(zmq.PULL), push, parent_pid=None)
        loop._handle(EngineCoreRequest(
            request_id="r", prompt_token_ids=[1], sampling_params=SamplingParams()))
        outs = msgspec.msgpack.decode(pull.recv(), type=EngineCoreOutputs)
    finally:
        ctx.destroy(linger=0)
    (o,) = outs.outputs
    assert o.finish_reason == FinishReason.ERROR and o.error == str(exc)
    assert o.error_param == param
    err = EngineRequestError(o.error, param=o.error_param)          # what the gateway raises
    assert err.status == 400 and err.param == param
