"""Client libraries people use, unmodified, against one real `formwork serve`
(issue 14): the openai SDK's parse helpers, instructor, langchain-openai,
pydantic-ai, openai-agents (its Chat Completions and Responses models) and litellm.

Every structured result goes back through the library's own parsing and is
validated again here. Schemas are nested pydantic models (a nested model and
an enum: `$defs`), bounded so that greedy SmolLM2-135M finishes quickly.
"""
from __future__ import annotations

import asyncio
import json
import os
from enum import Enum

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from test_server import KEY, Server

pytestmark = pytest.mark.slow
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no fetch at import
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")     # no export to OpenAI
MAX_TOKENS = 120


class Kind(str, Enum):
    cat = "cat"
    dog = "dog"


class Owner(BaseModel):
    name: str = Field(max_length=12)


class Pet(BaseModel):
    name: str = Field(max_length=12)
    kind: Kind
    owner: Owner


class Forecast(BaseModel):
    """Weather forecast for a city."""
    city: str = Field(max_length=16)
    unit: Kind | None = None      # an enum and a nested model reached through $defs
    owner: Owner


ASK = "Alice has a dog named Rex. Describe the pet as JSON."
MESSAGES = [{"role": "user", "content": ASK}]


def assert_pet(value) -> Pet:
    pet = value if isinstance(value, Pet) else Pet.model_validate(value)
    jsonschema.validate(pet.model_dump(mode="json"), Pet.model_json_schema())
    return pet


@pytest.fixture(scope="module")
def server():
    s = Server("--max-model-len", "1024", "--max-num-seqs", "8", "--kv-cache-memory-gb", "0.5")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return f"{server.url}/v1"


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    name = client.models.list().data[0].id
    assert client.models.retrieve(name).id == name          # GET /v1/models/{id}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    return name


# ---- openai SDK -------------------------------------------------------------------------

def test_openai_parse_nested_model(client, model):
    r = client.chat.completions.parse(model=model, messages=MESSAGES, response_format=Pet,
                                      temperature=0, max_tokens=MAX_TOKENS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and msg.tool_calls is None
    assert_pet(msg.parsed)


def test_openai_required_tool_with_defs(client, model):
    tool = openai.pydantic_function_tool(Forecast, name="forecast")
    r = client.chat.completions.parse(
        model=model, temperature=0, max_tokens=MAX_TOKENS, tools=[tool], tool_choice="required",
        messages=[{"role": "user", "content": "Forecast for Paris, asked by Bob."}])
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        assert call.function.name == "forecast"
        Forecast.model_validate(call.function.parsed_arguments)


class Tagged(BaseModel):
    title: str = Field(max_length=16)
    tags: set[str] = Field(max_length=3)           # uniqueItems: kept while decoding
    years: frozenset[int] = Field(max_length=3)


def test_openai_parse_sets_come_back_without_duplicates(client, model):
    """A pydantic set is `uniqueItems`; the raw text (before pydantic dedups it)
    has no repeated item, even where the model is asked to repeat one."""
    r = client.chat.completions.parse(
        model=model, response_format=Tagged, temperature=0, max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": "Repeat the tag 'cat' three times as tags, "
                                              "and the year 2000 three times."}])
    assert r.choices[0].finish_reason == "stop"
    raw = json.loads(r.choices[0].message.content)
    jsonschema.validate(raw, Tagged.model_json_schema())
    for key in ("tags", "years"):
        assert len(raw[key]) == len(set(raw[key]))
    assert r.choices[0].message.parsed == Tagged.model_validate(raw)


class Label(BaseModel):
    """Label a post."""
    labels: set[str] = Field(max_length=3)


def test_openai_required_tools_with_a_set_argument(client, model):
    """`tool_choice: required` over two tools (anyOf of calls told apart by name):
    a set in one tool's arguments comes back without repeats."""
    tools = [openai.pydantic_function_tool(Label, name="label"),
             openai.pydantic_function_tool(Forecast, name="forecast")]
    r = client.chat.completions.create(
        model=model, temperature=0, max_tokens=MAX_TOKENS, tools=tools, tool_choice="required",
        messages=[{"role": "user", "content": "Label this post 'news', 'news' and 'news'."}])
    calls = r.choices[0].message.tool_calls
    # Kept from repeating "news", greedy SmolLM2 makes its third label long; budget-aware
    # decoding closes the call at max_tokens ("length"), the arguments complete and valid.
    assert r.choices[0].finish_reason in ("tool_calls", "length") and calls
    for call in calls:
        raw = json.loads(call.function.arguments)
        if call.function.name == "label":
            assert len(raw["labels"]) == len(set(raw["labels"]))
            jsonschema.validate(raw, Label.model_json_schema())
        else:
            Forecast.model_validate(raw)


# ---- instructor -------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_modes(client, model, mode):
    import instructor
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    pet = patched.chat.completions.create(model=model, response_model=Pet, messages=MESSAGES,
                                          temperature=0, max_tokens=MAX_TOKENS, max_retries=0)
    assert_pet(pet)


# ---- langchain-openai -------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_model(base_url, model):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(model=model, base_url=base_url, api_key=KEY, temperature=0,
                      max_tokens=MAX_TOKENS, max_retries=0, timeout=300)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat_model, method):
    assert_pet(chat_model.with_structured_output(Pet, method=method).invoke(ASK))


def test_langchain_bind_tools(chat_model):
    msg = chat_model.bind_tools([Forecast], tool_choice="any").invoke(
        "Forecast for Paris, asked by Bob.")
    assert msg.tool_calls and not msg.invalid_tool_calls
    for call in msg.tool_calls:
        assert call["name"] == "Forecast"
        Forecast.model_validate(call["args"])


# ---- pydantic-ai ------------------------------------------------------------------------

def test_pydantic_ai_agent_tool_output(base_url, model):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    llm = OpenAIChatModel(model, provider=OpenAIProvider(base_url=base_url, api_key=KEY))
    agent = Agent(llm, output_type=Pet, retries=0,
                  model_settings={"temperature": 0, "max_tokens": MAX_TOKENS})
    assert_pet(agent.run_sync(ASK).output)


# ---- openai-agents: its Chat Completions model and its default, the Responses model ------

@pytest.mark.parametrize("api, ask", [("chat", ASK),
                                      ("responses", "Alice has a dog named Rex. As JSON.")])
def test_openai_agents_function_tool_and_output_type(base_url, model, api, ask):
    """An agent with a function tool and an output_type sends both tools and the
    format (chat: response_format; responses: text.format): tool_choice auto lets
    the model answer in the format (greedy SmolLM2 does here, for each API's
    prompt), "required" makes it call the tool, round-tripped by the agent."""
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                        Runner, function_tool, set_tracing_disabled)
    set_tracing_disabled(True)
    calls = []

    @function_tool
    def city_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return "sunny"

    model_cls = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    llm = model_cls(model=model, openai_client=openai.AsyncOpenAI(
        base_url=base_url, api_key=KEY, max_retries=0, timeout=300))

    def agent(**settings) -> Agent:
        return Agent(name="pets", model=llm, tools=[city_weather], output_type=Pet,
                     model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS, **settings),
                     tool_use_behavior="stop_on_first_tool")
    async def both():
        answered = await Runner.run(agent(), ask, max_turns=2)
        assert not calls
        called = await Runner.run(agent(tool_choice="required"), "Weather in Paris?", max_turns=2)
        return answered, called
    answered, called = asyncio.run(both())
    assert_pet(answered.final_output)
    assert called.final_output == "sunny" and calls and all(isinstance(c, str) for c in calls)


# ---- litellm ----------------------------------------------------------------------------

def test_litellm_response_format(base_url, model):
    import litellm
    r = litellm.completion(model=f"openai/{model}", api_base=base_url, api_key=KEY,
                           messages=MESSAGES, response_format=Pet, temperature=0,
                           max_tokens=MAX_TOKENS, num_retries=0)
    assert r.choices[0].finish_reason == "stop"
    assert_pet(json.loads(r.choices[0].message.content))
