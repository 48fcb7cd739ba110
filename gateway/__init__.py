"""formwork's public entry points: the offline LLM and the parameter types."""
from schemas.sampling import SamplingParams
from schemas.structured import StructuredOutputsParams


def __getattr__(name):
    # LLM pulls in torch and the engine: import it only when asked for.
    if name == "LLM":
        from gateway.llm import LLM
        return LLM
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from gateway import output_processor
        return getattr(output_processor, name)
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "Logprob"]
