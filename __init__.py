"""formwork: a structured-output-first LLM serving gateway.

Public entry points::

    from formwork import LLM, SamplingParams, StructuredOutputsParams, Logprob

The subpackages follow the data flow (docs in README.md): ``formwork.gateway``
(HTTP server, offline ``LLM``, ``formwork`` CLI), ``formwork.core`` (EngineCore,
scheduler, KV cache manager), ``formwork.grammar`` (constrained-decoding
backends), ``formwork.gpu`` (model, attention, sampler), ``formwork.kernels``
(Triton kernels beside their torch references: ``bitmask.apply_bitmask``,
``kv_store.store_kv``, ``paged_attention.paged_attention``) and
``formwork.schemas`` (the typed messages every part speaks).

This file is the package root only: importing ``formwork`` pulls in the
parameter types, never torch; ``LLM`` and the output types load on first use.
"""
from formwork.grammar import deferred_iri

deferred_iri.defer()    # before anything imports jsonschema: ~1 s of every start

import sys as _sys  # noqa: E402
import types as _types  # noqa: E402

from formwork.schemas import sampling as _sampling  # noqa: E402
from formwork.schemas.sampling import BeamSearchParams, SamplingParams  # noqa: E402
from formwork.schemas.structured import StructuredOutputsParams  # noqa: E402

# vLLM's module paths, so that a vLLM script runs with only `vllm` renamed:
# `from vllm.sampling_params import StructuredOutputsParams` (its documented import),
# `from vllm.outputs import RequestOutput`. The outputs load on first use (torch).
sampling_params = _sys.modules.setdefault("formwork.sampling_params", _sampling)


def _outputs_getattr(name):
    if name in ("RequestOutput", "CompletionOutput"):
        from formwork.gateway import output_processor
        return getattr(output_processor, name)
    raise AttributeError(f"module 'formwork.outputs' has no attribute {name!r}")


outputs = _types.ModuleType("formwork.outputs", "vLLM's `vllm.outputs` path: RequestOutput, "
                           "CompletionOutput (from formwork.gateway.output_processor).")
outputs.__getattr__ = _outputs_getattr
outputs = _sys.modules.setdefault("formwork.outputs", outputs)


def _reader_getattr(name):
    from formwork.gateway import metrics_reader
    if name in ("Metric", "Counter", "Gauge", "Histogram", "Vector"):
        return getattr(metrics_reader, name)
    raise AttributeError(f"module 'formwork.v1.metrics.reader' has no attribute {name!r}")


# vLLM's `vllm.v1.metrics.reader` (what LLM.get_metrics returns), loaded on first use
for _name in ("formwork.v1", "formwork.v1.metrics", "formwork.v1.metrics.reader"):
    _sys.modules.setdefault(_name, _types.ModuleType(_name))
_sys.modules["formwork.v1.metrics.reader"].__getattr__ = _reader_getattr
_sys.modules["formwork.v1"].metrics = _sys.modules["formwork.v1.metrics"]
_sys.modules["formwork.v1.metrics"].reader = _sys.modules["formwork.v1.metrics.reader"]
v1 = _sys.modules["formwork.v1"]


def __getattr__(name):
    # LLM pulls in torch and the engine: import it only when asked for.
    if name == "LLM":
        from formwork.gateway.llm import LLM
        return LLM
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from formwork.gateway import output_processor
        return getattr(output_processor, name)
    raise AttributeError(f"module 'formwork' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "RequestOutput",
           "CompletionOutput", "Logprob"]
