"""Tensor parallelism (Megatron-style) for the Llama decoder: how the model is
split over N ranks and the collectives the ranks share.

Owns the sharding rules and the process groups; the model code is unchanged
except that row-parallel linears are wrapped in `RowParallel`:

- q/k/v and gate/up are column-parallel: rank r keeps query heads
  [r*H/N, (r+1)*H/N), KV heads [r*KVH/N, (r+1)*KVH/N) and the same slice of the
  intermediate size, so each rank's model is the full model with H/N, KVH/N and
  I/N (`shard_config`) and its paged KV cache holds only its own KV heads;
- o_proj and down_proj are row-parallel: each rank multiplies its slice of the
  input features and one all-reduce (sum) per layer output joins them; a bias
  is kept on rank 0 only (zeros elsewhere), so it is added once;
- embeddings, norms and lm_head are replicated (135M parameters: the logits
  are computed, and sampled, on rank 0 only).

Process groups: `device_group` (NCCL on CUDA, gloo on CPU) carries the
all-reduces; `cpu_group` (gloo, no practical timeout: workers idle in it)
carries the per-step plan broadcast.
"""
from __future__ import annotations

import dataclasses
import datetime
import socket

import msgspec
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from formwork.gpu.model import LlamaForCausalLM, ModelConfig
from formwork.schemas.scheduler import SchedulerOutput

STEP_TIMEOUT = datetime.timedelta(seconds=300)    # rendezvous and every collective of a step
# Workers wait for the next plan as long as the engine idles; the default timeout
# would end them after STEP_TIMEOUT of quiet (a dead rank 0 still ends the wait:
# its connections close, and its death signals them).
IDLE_TIMEOUT = datetime.timedelta(days=365)
# The plan crosses as msgpack: measured on a 16-request decode plan, encode 3 us and
# decode 5 us against pickle's 16 us and 12 us. A gloo broadcast between two local
# processes cost ~200 us whether it carried 8 bytes or 64 KiB (loaded 2-core box), so
# a plan goes in one broadcast of a fixed buffer (length prefix + bytes), with a
# second only for a plan that does not fit (~150+ requests).
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SchedulerOutput | None)
PLAN_BUFFER_BYTES = 16 << 10
_LEN = 8                                       # little-endian length prefix


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS picks; another process could still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def shard_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """One rank's view of the model; ValueError naming tensor_parallel_size unless
    heads, KV heads and intermediate size divide evenly."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(cfg, name)
        if value % tp_size:
            raise ValueError(
                f"tensor_parallel_size: {tp_size} does not divide the model's {name} ({value}); "
                f"choose a tensor_parallel_size that divides num_attention_heads "
                f"({cfg.num_attention_heads}), num_key_value_heads ({cfg.num_key_value_heads}) "
                f"and intermediate_size ({cfg.intermediate_size})")
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // tp_size,
        num_key_value_heads=cfg.num_key_value_heads // tp_size,
        intermediate_size=cfg.intermediate_size // tp_size)


def shard_hf_weights(hf: dict[str, torch.Tensor], cfg: ModelConfig, rank: int,
                     tp_size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice of full HF-named weights (does not mutate `hf`).
    Column-parallel weights [out, in] are cut along out, row-parallel along in;
    slices are copies, so the full tensors can be freed."""
    d = cfg.head_dim
    cols = {"q_proj": cfg.num_attention_heads * d // tp_size,
            "k_proj": cfg.num_key_value_heads * d // tp_size,
            "v_proj": cfg.num_key_value_heads * d // tp_size,
            "gate_proj": cfg.intermediate_size // tp_size,
            "up_proj": cfg.intermediate_size // tp_size}
    rows = {"o_proj": cfg.num_attention_heads * d // tp_size,
            "down_proj": cfg.intermediate_size // tp_size}
    out = {}
    for name, w in hf.items():
        parts = name.split(".")
        proj, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
        if proj in cols:
            n = cols[proj]
            w = w[rank * n:(rank + 1) * n].clone(memory_format=torch.contiguous_format)
        elif proj in rows and kind == "weight":
            n = rows[proj]
            w = w[:, rank * n:(rank + 1) * n].clone(memory_format=torch.contiguous_format)
        elif proj in rows and kind == "bias" and rank != 0:
            w = torch.zeros_like(w)
        out[name] = w
    return out


class RowParallel(nn.Module):
    """A row-parallel linear: this rank's partial product, summed over ranks.
    Input [..., in/N] -> [..., out] (the same on every rank)."""

    def __init__(self, linear: nn.Module, group: "TPGroup"):
        super().__init__()
        self.linear = linear          # an nn.Linear; pack_linears may swap in a PackedLinear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        dist.all_reduce(out, group=self.group.device_group)
        return out


def parallelize(model: LlamaForCausalLM, group: "TPGroup") -> None:
    """Wrap o_proj and down_proj of every layer in `RowParallel` (in place)."""
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)


@dataclasses.dataclass(slots=True)
class TPGroup:
    """This process's membership of one engine's tensor-parallel group."""
    rank: int
    size: int
    device_group: object          # all-reduces (NCCL on CUDA, gloo on CPU)
    cpu_group: object             # plan broadcast and start-up agreement (gloo, IDLE_TIMEOUT)
    plan_buffer: torch.Tensor = dataclasses.field(
        default_factory=lambda: torch.zeros(PLAN_BUFFER_BYTES, dtype=torch.uint8))

    @classmethod
    def init(cls, rank: int, size: int, init_method: str, device: torch.device, *,
             timeout: datetime.timedelta = STEP_TIMEOUT,
             idle_timeout: datetime.timedelta = IDLE_TIMEOUT) -> "TPGroup":
        """Rendezvous with the other ranks (blocks until all have joined)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timeout, device_id=device if backend == "nccl" else None)
        cpu_group = dist.new_group(backend="gloo", timeout=idle_timeout)
        return cls(rank, size, dist.group.WORLD, cpu_group)

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (e.g. KV blocks that fit on every rank)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast_plan(self, plan: SchedulerOutput | None) -> SchedulerOutput | None:
        """Rank 0 sends `plan` (None: stop); every other rank returns what rank 0 sent
        (an equal copy). One gloo broadcast of the plan buffer, two for a large plan."""
        buf = self.plan_buffer.numpy()
        head = PLAN_BUFFER_BYTES - _LEN
        if self.rank == 0:
            data = _ENCODER.encode(plan)
            buf[:_LEN] = np.frombuffer(len(data).to_bytes(_LEN, "little"), dtype=np.uint8)
            buf[_LEN:_LEN + min(len(data), head)] = np.frombuffer(data[:head], dtype=np.uint8)
        dist.broadcast(self.plan_buffer, src=0, group=self.cpu_group)
        n = int.from_bytes(buf[:_LEN].tobytes(), "little")
        tail = b""
        if n > head:
            rest = (torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8) if self.rank == 0
                    else torch.empty(n - head, dtype=torch.uint8))
            dist.broadcast(rest, src=0, group=self.cpu_group)
            tail = rest.numpy().tobytes()
        if self.rank == 0:
            return plan
        return _DECODER.decode(buf[_LEN:_LEN + min(n, head)].tobytes() + tail)

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
