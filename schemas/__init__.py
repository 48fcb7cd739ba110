"""The language every box speaks. Depends on nothing else in formwork.

- msgspec structs for what crosses the gateway <-> EngineCore boundary
  (`engine.py`, `sampling.py`, `structured.py`);
- plain dataclasses for what stays inside the EngineCore process
  (`config.py`, `scheduler.py`);
- pydantic models for the OpenAI HTTP protocol (`openai.py`).
"""
from schemas.config import EngineConfig
from schemas.engine import (
    EngineCoreAbort,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Logprob,
)
from schemas.sampling import SamplingParams
from schemas.structured import StructuredOutputsParams

__all__ = [
    "EngineConfig",
    "EngineCoreAbort",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "FinishReason",
    "Logprob",
    "SamplingParams",
    "StructuredOutputsParams",
]
