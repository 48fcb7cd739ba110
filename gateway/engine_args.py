"""Engine flags shared by `formwork serve` and `formwork extract`, generated from
EngineConfig's fields so that a new field cannot go without one: the argparse
group, and the EngineConfig built back from the parsed arguments. gateway/cli.py
and gateway/extract/cli.py both import this; it imports neither.

Field `name` becomes `--name` (dashes for underscores), typed by its annotation
and defaulting to the dataclass default; a bool field becomes a switch away from
its default: `--no-name` (an `enable_` prefix dropped) when it defaults to True,
`--name` when it defaults to False. FLAGS adds help texts, choices, short aliases
and the names that differ from that rule. `model` is each command's own argument
(serve: positional; extract: --model, exclusive with --server).
"""
from __future__ import annotations

import argparse
import dataclasses
import decimal
import typing

from formwork.schemas.config import ATTENTION_BACKENDS, DEVICES, DTYPES, SCHEDULING_POLICIES, EngineConfig

COMMAND_FIELDS = frozenset({"model"})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Flag:
    help: str | None = None
    choices: tuple[str, ...] | None = None
    name: str | None = None              # the flag, where the rule's name is not it
    aliases: tuple[str, ...] = ()


FLAGS: dict[str, Flag] = {
    "dtype": Flag(choices=DTYPES),
    "device": Flag(choices=DEVICES),
    "attention_backend": Flag(choices=ATTENTION_BACKENDS),
    "max_model_len": Flag(help="context length (default: the model's max positions)"),
    "scheduling_policy": Flag(choices=SCHEDULING_POLICIES,
                              help="priority: waiting requests are served by their `priority` "
                                   "(lower first, then arrival) instead of first come, first served; "
                                   "preemption takes the highest value first"),
    "num_kv_blocks": Flag(help="KV cache blocks (default: from --kv-cache-memory-gb / GPU memory)"),
    "kv_cache_memory_gb": Flag(help="CPU: memory given to the paged KV cache"),
    "structured_backend": Flag(name="--structured-outputs-backend",
                               choices=("auto", "llguidance", "xgrammar", "outlines", "guidance")),
    "grammar_compile_timeout_s": Flag(
        name="--grammar-compile-timeout",
        help="seconds a request's grammar may take to compile; after that the request fails"),
    "budget_aware": Flag(help="do not close JSON outputs (schemas, json_object, tool calls) "
                              "before max_tokens runs out (per request: "
                              "structured_outputs.budget_aware)"),
    "defer_grammar_masks": Flag(help="fill every constrained request's grammar mask beside the "
                                     "forward, instead of checking the unmasked pick of greedy and "
                                     "temperature-only requests first and masking only refused ones"),
    "num_threads": Flag(help="torch intra-op threads"),
    "adaptive_threads": Flag(help="CPU: keep --num-threads fixed instead of sizing the forward's "
                                  "thread team to the cores other processes leave free"),
    "logprobs_mode": Flag(choices=("raw_logprobs", "processed_logprobs"),
                          help="returned logprobs: the model's own (vLLM's default), or after the "
                               "grammar mask and penalties"),
    "load_format": Flag(choices=("auto", "dummy"),
                        help="dummy: build the model from its config.json with random weights "
                             "(speed and memory measurements without the checkpoint)"),
    "enforce_eager": Flag(help="never capture CUDA graphs: every step runs eagerly (default: decode "
                               "steps replay CUDA graphs on CUDA with the Triton attention backend)"),
    "packed_linears": Flag(help="CPU bf16: call the plain linear instead of oneDNN weights packed "
                                "at load"),
    "fused_elementwise": Flag(help="run norms, rotary and silu as separate torch ops, not the fused "
                                   "C++ ones (CPU bf16) or Triton ones (CUDA)"),
    "data_parallel_size": Flag(aliases=("-dp",),
                               help="engine processes behind this gateway, each with its own "
                                    "scheduler and KV cache; requests routed by load and prefix "
                                    "affinity"),
    "tensor_parallel_size": Flag(aliases=("-tp",),
                                 help="worker processes per engine, the model sharded over "
                                      "torch.distributed (gloo on CPU, NCCL on CUDA)"),
    "distributed_executor_backend": Flag(choices=("mp", "ray"),
                                         help="mp: local processes; ray: engines as Ray actors on "
                                              "a running Ray cluster (README 'Scaling out')"),
}


def engine_fields() -> list[dataclasses.Field]:
    """EngineConfig's fields that are engine flags, in declaration order."""
    return [f for f in dataclasses.fields(EngineConfig) if f.name not in COMMAND_FIELDS]


def flag_name(field: dataclasses.Field) -> str:
    """The long flag of `field`: FLAGS' name, else the rule in the module docstring."""
    spec = FLAGS.get(field.name)
    if spec is not None and spec.name is not None:
        return spec.name
    if field.default is True:
        return "--no-" + field.name.removeprefix("enable_").replace("_", "-")
    return "--" + field.name.replace("_", "-")


_HUMAN_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_int(text: str) -> int:
    """An int, or vLLM's human-readable form: 1k = 1000, 1K = 1024, 25.6k = 25600
    (k/m/g decimal, K/M/G binary)."""
    text = text.strip()
    if text[-1:] in _HUMAN_SUFFIXES:
        try:       # Decimal: 0.3k is 300, not 300.00000000000006
            value = decimal.Decimal(text[:-1]) * _HUMAN_SUFFIXES[text[-1]]
        except decimal.InvalidOperation:
            raise argparse.ArgumentTypeError(f"invalid size {text!r}") from None
        if not value.is_finite():
            raise argparse.ArgumentTypeError(f"invalid size {text!r}")
        if value != int(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
        return int(value)
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None


# token counts that take vLLM's human-readable sizes ("4k", "32K")
_HUMAN_SIZED = frozenset({"max_model_len", "max_num_batched_tokens"})


def _value_type(annotation: object) -> type:
    """The type a flag's string converts to: int for `int | None`, and so on."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    assert len(args) <= 1, f"EngineConfig: no flag type for {annotation}"
    return args[0] if args else annotation


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """An "engine" group with one flag per engine field; each stores under the field's
    name. The command adds `model` itself."""
    hints = typing.get_type_hints(EngineConfig)
    g = p.add_argument_group("engine")
    for f in engine_fields():
        spec = FLAGS.get(f.name, Flag())
        names = (flag_name(f), *spec.aliases)
        kind = _value_type(hints[f.name])
        if kind is bool:
            g.add_argument(*names, dest=f.name, default=f.default, help=spec.help,
                           action="store_false" if f.default else "store_true")
        else:
            g.add_argument(*names, dest=f.name, choices=spec.choices, default=f.default,
                           type=human_int if f.name in _HUMAN_SIZED else kind, help=spec.help)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed arguments (the engine group and the command's `model`);
    raises ValueError naming the bad field."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})
