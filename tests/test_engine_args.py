"""The engine flags of `formwork serve` and `formwork extract` (gateway/engine_args.py):
every EngineConfig field has one in both commands, each round-trips through
engine_config(parse_args(...)), and no flag name or alias users rely on is lost."""
from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from formwork.gateway.cli import add_serve_arguments, main
from formwork.gateway.engine_args import COMMAND_FIELDS, FLAGS, engine_config, engine_fields, flag_name
from formwork.gateway.extract import cli as extract_cli
from formwork.schemas.config import EngineConfig

# every name the flags had before they were generated; none may disappear
KNOWN_FLAGS = (
    "--dtype", "--device", "--attention-backend", "--max-model-len", "--block-size",
    "--num-kv-blocks", "--kv-cache-memory-gb", "--gpu-memory-utilization", "--max-num-seqs",
    "--max-num-batched-tokens", "--no-chunked-prefill", "--no-prefix-caching",
    "--structured-outputs-backend", "--grammar-compile-threads", "--no-jump-forward",
    "--no-budget-aware", "--num-threads", "--logprobs-mode", "--no-adaptive-threads", "--seed",
    "--enforce-eager", "--no-packed-linears", "--no-fused-elementwise", "--data-parallel-size",
    "-dp", "--tensor-parallel-size", "-tp", "--distributed-executor-backend")
# a value the generic rule in `changed` would get wrong (none today)
CHANGED: dict[str, object] = {}


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p


def extract_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    extract_cli.add_arguments(p)
    return p


COMMANDS = {"serve": (serve_parser, ["MODEL"]),
            "extract": (extract_parser, ["--schema", "s.json", "doc.txt", "--model", "MODEL"])}


def changed(f: dataclasses.Field) -> object:
    """A valid value of field `f` other than its default."""
    if f.name in CHANGED:
        return CHANGED[f.name]
    spec = FLAGS.get(f.name)
    if isinstance(f.default, bool):
        return not f.default
    if spec is not None and spec.choices:
        return next(c for c in reversed(spec.choices) if c != f.default)
    if isinstance(f.default, (int, float)):
        return f.default * 2 if f.default else type(f.default)(3)
    if f.default is None:
        return 3
    raise AssertionError(f"add a changed value for EngineConfig.{f.name} to CHANGED")


def argv_for(values: dict[str, object]) -> list[str]:
    argv = []
    for f in engine_fields():
        if isinstance(f.default, bool):
            argv += [flag_name(f)] if values[f.name] != f.default else []
        else:
            argv += [flag_name(f), str(values[f.name])]
    return argv


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_has_a_flag(command):
    make, head = COMMANDS[command]
    dests = vars(make().parse_args(head))
    missing = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in dests]
    assert missing == [], f"EngineConfig fields without a flag in {command}: {missing}"
    assert COMMAND_FIELDS == {"model"}


@pytest.mark.parametrize("command", COMMANDS)
def test_defaults_are_the_config_defaults(command):
    make, head = COMMANDS[command]
    config = engine_config(make().parse_args(head))
    assert config == dataclasses.replace(EngineConfig(), model="MODEL")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_round_trips(command):
    values = {f.name: changed(f) for f in engine_fields()}
    assert all(values[f.name] != f.default for f in engine_fields())
    make, head = COMMANDS[command]
    config = engine_config(make().parse_args(head + argv_for(values)))
    assert config == EngineConfig(model="MODEL", **values)


@pytest.mark.parametrize("command", COMMANDS)
def test_short_aliases(command):
    make, head = COMMANDS[command]
    config = engine_config(make().parse_args(head + ["-dp", "3", "-tp", "2"]))
    assert (config.data_parallel_size, config.tensor_parallel_size) == (3, 2)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_lists_every_flag(command, capsys):
    head = ["extract"] if command == "extract" else ["serve"]
    with pytest.raises(SystemExit) as exit_:
        main(head + ["--help"])
    assert exit_.value.code == 0
    shown = capsys.readouterr().out
    missing = [n for n in KNOWN_FLAGS + tuple(flag_name(f) for f in engine_fields())
               if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", shown)]
    assert missing == []


def test_bad_value_names_the_field():
    args = serve_parser().parse_args(["--block-size", "12"])
    with pytest.raises(ValueError, match="block_size"):
        engine_config(args)


def test_a_vllm_serve_command_line_is_taken():
    """`vllm serve` flags: mapped where they mean something here, accepted where they
    have nothing to do, refused (argparse) where formwork has no such thing."""
    from formwork.gateway.cli import apply_vllm_arguments, build_parser
    from formwork.gateway.serve_options import options_from_args

    argv = ("serve --model /m --trust-remote-code --enable-auto-tool-choice --tool-call-parser "
            "hermes --guided-decoding-backend xgrammar --no-enable-prefix-caching --swap-space 4 "
            "--kv-cache-dtype auto --disable-log-requests --disable-log-stats "
            "--enable-chunked-prefill --uvicorn-log-level trace --max-model-len 2048 "
            "--reasoning-parser deepseek_r1").split()
    args = build_parser(argv).parse_args(argv)
    apply_vllm_arguments(args)
    config = engine_config(args)
    assert (config.model, config.structured_backend, config.enable_prefix_caching,
            config.max_model_len, args.log_level) == ("/m", "xgrammar", False, 2048, "debug")
    assert args.reasoning_parser == "deepseek_r1"
    assert options_from_args(args)[1].tool_call_parser == "hermes"
    llama = ["serve", "/m", "--tool-call-parser", "llama3_json"]
    assert options_from_args(build_parser(llama).parse_args(llama))[1].tool_call_parser == \
        "llama3_json"
    same = build_parser(["serve"]).parse_args(["serve", "/m", "--model", "/m"])
    apply_vllm_arguments(same)
    assert same.model == "/m"
    clash = build_parser(["serve"]).parse_args(["serve", "/a", "--model", "/b"])
    with pytest.raises(ValueError, match="two models"):
        apply_vllm_arguments(clash)
    for bad in (["--tool-call-parser", "mistral"], ["--kv-cache-dtype", "fp8"],
                ["--reasoning-parser", "granite"]):
        with pytest.raises(SystemExit):
            build_parser(["serve"]).parse_args(["serve", *bad])
