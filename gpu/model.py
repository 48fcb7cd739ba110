"""Llama-family decoder over a flat packed batch and a paged KV cache.

Numerics follow HF transformers' LlamaForCausalLM (RMSNorm in fp32, RoPE
cos/sin computed in fp32 then cast, rotate-half layout); q/k/v and gate/up
projections are fused into single matmuls.
"""
from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from formwork.gpu.attention import AttentionBackend, AttentionMetadata
from formwork.gpu.attention_torch import TorchAttentionBackend
from formwork.kernels import cpu_fused_ops as fused
from formwork.kernels import fused_ops as triton_fused

KVCache = tuple[torch.Tensor, torch.Tensor]

# Measured on CPU (fp32, SmolLM2 shapes): two gate/up matmuls beat one fused
# matmul for small row counts (decode steps), the fused one wins for prefills.
# CUDA always takes the one matmul and the fused silu_mul.
_SPLIT_GATE_UP_ROWS = 64


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None          # None or llama3 parameters
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    attention_bias: bool = False        # q/k/v projections carry a bias
    mlp_bias: bool = False
    o_proj_bias: bool = False           # the output projection too (Llama's attention_bias)
    qk_norm: bool = False               # RMSNorm over each q / k head before RoPE (Qwen3)

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> "ModelConfig":
        return cls.from_dict(json.loads((pathlib.Path(path) / "config.json").read_text()))

    @classmethod
    def from_dict(cls, c: dict) -> "ModelConfig":
        model_type = c.get("model_type", "llama")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported (only silu)")
        heads = c["num_attention_heads"]
        # transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`.
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", c.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope scaling {rope_type!r} is not supported (default or llama3 only)")
        eos = c.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_scaling=rope if rope_type == "llama3" else None,
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            bos_token_id=c.get("bos_token_id"), eos_token_ids=eos_ids,
            # Qwen2 is Llama with biased q/k/v projections (its config says nothing of it);
            # Llama's `attention_bias` puts a bias on o_proj as well
            attention_bias=model_type == "qwen2" or bool(c.get("attention_bias", False)),
            o_proj_bias=model_type != "qwen2" and bool(c.get("attention_bias", False)),
            mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",      # Qwen3 is Llama with per-head q/k norms
        )


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies (llama3 scaling applied if set)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_scaling is None:
        return inv
    r = cfg.rope_scaling
    factor, lo, hi = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
    old_len = r["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
    return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True, slots=True)
class LayerOps:
    """The layer's elementwise ops (signatures and contracts: kernels/cpu_fused_ops.py)."""
    rms_norm: Callable
    add_rms_norm: Callable      # updates the residual in place
    rotary: Callable            # may rotate qkv in place
    silu_mul: Callable


TORCH_OPS = LayerOps(fused.rms_norm_ref, fused.add_rms_norm_ref, fused.rotary_ref, fused.silu_mul_ref)
CPU_FUSED_OPS = LayerOps(fused.rms_norm, fused.add_rms_norm, fused.rotary, fused.silu_mul)
CUDA_FUSED_OPS = LayerOps(triton_fused.rms_norm, triton_fused.add_rms_norm, triton_fused.rotary,
                          triton_fused.silu_mul)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class RotaryEmbedding(nn.Module):
    """cos/sin caches [max_positions, head_dim] indexed by absolute position."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def reset(self, device: torch.device, dtype: torch.dtype) -> None:
        pos = torch.arange(self.cfg.max_position_embeddings, dtype=torch.float32)
        freqs = pos[:, None] * rope_inv_freq(self.cfg)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.scale = self.d ** -0.5
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def _qk_norm(self, qkv: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """Qwen3: each q and k head RMS-normed over head_dim (shared weights), v as is."""
        t, hd, kd = qkv.shape[0], self.h * self.d, self.kvh * self.d
        q = ops.rms_norm(qkv[:, :hd].reshape(-1, self.d), self.q_norm.weight, self.q_norm.eps)
        k = ops.rms_norm(qkv[:, hd:hd + kd].reshape(-1, self.d), self.k_norm.weight, self.k_norm.eps)
        return torch.cat((q.view(t, hd), k.view(t, kd), qkv[:, hd + kd:]), dim=1)

    def forward(self, x, positions, rotary, kv_cache: KVCache, meta, backend, ops: LayerOps) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)                        # [T, (H + 2 KVH) * D]
        if self.qk_norm:
            qkv = self._qk_norm(qkv, ops)
        q, k = ops.rotary(qkv, positions, rotary.cos, rotary.sin, self.h, self.kvh)
        v = qkv[:, (self.h + self.kvh) * self.d:].view(t, self.kvh, self.d)
        o = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(t, self.h * self.d))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        if x.shape[0] <= _SPLIT_GATE_UP_ROWS and x.device.type == "cpu" \
                and type(self.gate_up_proj) is nn.Linear \
                and self.gate_up_proj.bias is None:       # (a packed linear is faster fused)
            w = self.gate_up_proj.weight  # two contiguous halves: no copy
            gate, up = F.linear(x, w[:self.inter]), F.linear(x, w[self.inter:])
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, residual, positions, rotary, kv_cache, meta, backend, ops: LayerOps):
        """x: the previous layer's output, or the embeddings with residual None.
        Returns (output, residual); the stream is residual + output (HF's
        `x + attn(norm(x))`, `x + mlp(norm(x))`, the add fused into the next norm)."""
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, h = x, ops.rms_norm(x, n1.weight, n1.eps)
        else:
            h, residual = ops.add_rms_norm(x, residual, n1.weight, n1.eps)
        h = self.self_attn(h, positions, rotary, kv_cache, meta, backend, ops)
        h, residual = ops.add_rms_norm(h, residual, n2.weight, n2.eps)
        return self.mlp(h, ops), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # `_weight`: no random init (its `normal_`, on the meta device the loader builds
        # on, imports torch._dynamo: ~1.2 s of every engine start); weights are loaded after
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names match HF except the fused `qkv_proj` / `gate_up_proj`."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend | None = None,
                 ops: LayerOps | None = None):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        # both fixed for the model's life; each step's metadata comes from the
        # backend's build_metadata
        self.attn_backend = attn_backend or TorchAttentionBackend()
        self.ops = ops or TORCH_OPS

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids/positions [T] (sequences contiguous, in order) -> normed hidden [T, hidden].
        Writes the new tokens' K/V into `kv_caches` (one (k, v) per layer)."""
        x, residual = self.model.embed_tokens(input_ids), None
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, self.rotary, kv, attn_metadata,
                                self.attn_backend, self.ops)
        norm = self.model.norm
        return self.ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] float32."""
        return self.lm_head(hidden).float()

    def init_dummy_weights(self, *, dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        """Random weights, uniform in [-1e-3, 1e-3] as vLLM's `load_format="dummy"`:
        for speed and memory measurements without the checkpoint (a realistic
        shape from its config.json alone). Materialised on `device` directly."""
        gen = torch.Generator(device=device).manual_seed(seed)
        for module in self.modules():   # each parameter allocated once, in `dtype`
            for name, p in module.named_parameters(recurse=False):
                w = torch.empty(p.shape, dtype=dtype, device=device).uniform_(-1e-3, 1e-3, generator=gen)
                setattr(module, name, nn.Parameter(w, requires_grad=False))
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary.reset(device, dtype)
        self.requires_grad_(False)

    def load_hf_weights(self, hf: dict[str, torch.Tensor], *, dtype: torch.dtype,
                        device: torch.device) -> None:
        """Assign HF-named weights (fusing q/k/v and gate/up), then build RoPE caches."""
        sd = {}
        tied = self.config.tie_word_embeddings
        for name, w in hf.items():
            if name.startswith("lm_head.") and tied:
                continue
            if ".rotary_emb." in name:
                continue
            sd[name] = w
        if tied and "model.embed_tokens.weight" not in sd and "lm_head.weight" in hf:
            sd["model.embed_tokens.weight"] = hf["lm_head.weight"]   # saved under the head's name

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise ValueError(f"checkpoint has no {name} (the model's config needs it)")
            return sd.pop(name)

        for i in range(self.config.num_hidden_layers):
            p = f"model.layers.{i}."
            for kind in ("weight", "bias") if self.config.attention_bias else ("weight",):
                parts = [take(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv"]
                sd[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(parts)
            for kind in ("weight", "bias") if self.config.mlp_bias else ("weight",):
                parts = [take(f"{p}mlp.{x}_proj.{kind}") for x in ("gate", "up")]
                sd[f"{p}mlp.gate_up_proj.{kind}"] = torch.cat(parts)
        if tied and "model.embed_tokens.weight" in sd:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        # name what is missing or left over (load_state_dict's own error lists every
        # key of the fused layout, which is not the checkpoint's)
        wanted = set(self.state_dict())
        missing = sorted(wanted - set(sd))
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s) the model's config "
                             f"needs: {', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}")
        unexpected = sorted(set(sd) - wanted)
        if unexpected:
            raise ValueError(f"checkpoint has {len(unexpected)} weight(s) this model does not use "
                             f"(another architecture?): "
                             f"{', '.join(unexpected[:5])}{', ...' if len(unexpected) > 5 else ''}")
        sd = {k: v.to(device=device, dtype=dtype).contiguous() for k, v in sd.items()}
        self.load_state_dict(sd, strict=True, assign=True)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary.reset(device, dtype)
        self.requires_grad_(False)
