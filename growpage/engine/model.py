"""Llama-architecture decoder (and the Qwen3 variant) over the paged KV cache.

Module and parameter names follow Hugging Face (``model.layers.0.self_attn.q_proj.weight``...)
so that safetensors checkpoints load as they are. Tokens of all sequences of a step are packed
into one ``[T]`` batch; attention metadata comes from the step context (``engine.context``).
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from growpage.core.rope import RopeConfig, apply_rope, cos_sin
from growpage.engine.attention import AttentionBackend, TorchAttentionBackend
from growpage.engine.context import get_context

SUPPORTED_ARCHS = ("llama", "qwen3")


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value <= 0:
        raise ValueError(f"ModelConfig.{attribute.name} must be > 0, got {value}")


@attrs.frozen
class ModelConfig:
    """Shape and numerics of a decoder; ``qk_norm`` selects the Qwen3 variant."""

    arch: str = attrs.field(validator=attrs.validators.in_(SUPPORTED_ARCHS))
    vocab_size: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    num_layers: int = attrs.field(validator=_positive)
    num_q_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    rope: RopeConfig
    rms_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    max_position: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    name: str = ""

    def __attrs_post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig: num_q_heads ({self.num_q_heads}) must be a multiple "
                             f"of num_kv_heads ({self.num_kv_heads})")
        if self.rope.head_dim != self.head_dim:
            raise ValueError(f"ModelConfig: rope.head_dim ({self.rope.head_dim}) != head_dim "
                             f"({self.head_dim})")

    def to_dict(self) -> dict:
        return attrs.asdict(self, value_serializer=lambda _i, _a, v: list(v)
                            if isinstance(v, tuple) else v)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        d = dict(d)
        d["rope"] = RopeConfig.from_dict(d["rope"])
        return cls(**d)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dimension, computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """GQA self-attention; records the pre-RoPE query into the step capture when asked."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_q_heads, self.num_kv_heads = cfg.num_q_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_q_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_q_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.qk_norm = cfg.qk_norm
        self.backend = backend
        # View [2, num_pages, page_size, Hkv, d] of the shared cache; not a module buffer.
        self.kv_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]``, ``cos/sin [T, 1, d]`` -> ``[T, hidden]``."""
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_q_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        ctx = get_context()
        q_pre_rope = q
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if ctx.capture is not None:
            ctx.capture.record(self.layer_idx, q_pre_rope, k, v)
        out = self.backend.forward(q, k, v, self.kv_cache, ctx, self.scale)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, layer_idx, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)


class CausalLM(nn.Module):
    """Decoder with an LM head (tied to the embeddings when the config says so)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.backend = backend if backend is not None else TorchAttentionBackend()
        self.model = DecoderModel(cfg, self.backend)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the packed step tokens ``input_ids [T]`` at
        absolute ``positions [T]``; needs a step context (``use_context``)."""
        cos, sin = cos_sin(self.config.rope, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, d], broadcast over heads
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden] -> logits [N, vocab]`` in fp32."""
        weight = (self.model.embed_tokens.weight if self.config.tie_word_embeddings
                  else self.lm_head.weight)
        return nn.functional.linear(hidden, weight).float()

    def bind_kv_cache(self, kv_cache: torch.Tensor | None) -> None:
        """Give each layer its view of ``kv_cache [2, L, num_pages, page_size, Hkv, d]``."""
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.kv_cache = None if kv_cache is None else kv_cache[:, i]
