"""Llama-architecture decoder (and the Qwen2 and Qwen3 variants) over the paged KV cache.

Qwen2 is Llama with biases on the q/k/v projections (``attention_bias``); Qwen3 adds RMS norms
of q and k per head (``qk_norm``). All use rotate-half RoPE.

State-dict names follow Hugging Face (``model.layers.0.self_attn.q_proj.weight``...) so that
safetensors checkpoints load as they are. Inside, q/k/v and gate/up are each one fused
projection (one GEMM): ``FusedLinear`` concatenates the HF weights on load and splits them again
in ``state_dict()``. Tokens of all sequences of a step are packed into one ``[T]`` batch;
attention metadata comes from the step context (``modeling.step_context``).
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from growpage._convert import int_tuple
from growpage.core.rope import RopeConfig, inv_frequencies_on
from growpage.engine.modeling.attention import AttentionBackend, TorchAttentionBackend
from growpage.engine.modeling.fused_linear import FusedLinear
from growpage.engine.modeling.step_context import get_context
from growpage.validators import one_of, positive_int

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


@attrs.frozen
class ModelConfig:
    """Shape and numerics of a decoder; ``attention_bias`` is Qwen2's q/k/v bias, ``qk_norm``
    Qwen3's q/k norm."""

    arch: str = attrs.field(validator=one_of(SUPPORTED_ARCHS))
    vocab_size: int = attrs.field(validator=positive_int)
    hidden_size: int = attrs.field(validator=positive_int)
    intermediate_size: int = attrs.field(validator=positive_int)
    num_layers: int = attrs.field(validator=positive_int)
    num_q_heads: int = attrs.field(validator=positive_int)
    num_kv_heads: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(validator=positive_int)
    rope: RopeConfig
    rms_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    max_position: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = attrs.field(default=(), converter=int_tuple)
    name: str = ""

    def __attrs_post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig: num_q_heads ({self.num_q_heads}) must be a multiple "
                f"of num_kv_heads ({self.num_kv_heads})"
            )
        if self.rope.head_dim != self.head_dim:
            raise ValueError(
                f"ModelConfig: rope.head_dim ({self.rope.head_dim}) != head_dim ({self.head_dim})"
            )

    def to_dict(self) -> dict:
        return attrs.asdict(
            self, value_serializer=lambda _i, _a, v: list(v) if isinstance(v, tuple) else v
        )

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
        """Hugging Face's order: normalize in fp32, round to the input dtype, then scale.

        Bitwise equal on CPU to ``w * (xf * rsqrt(mean(xf**2) + eps)).to(dtype)`` with
        ``xf = x.float()`` (tested): one fused op for fp32, four for bf16 / fp16 (eight before).
        """
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = nn.functional.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return normed.to(x.dtype) * self.weight


def rope_tables(cfg: RopeConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [T, 1, d/2]`` (fp32) of ``positions [T]``: the first half of
    ``core.rope.cos_sin`` (its second half repeats it), broadcast over heads."""
    inv = inv_frequencies_on(cfg, positions.device)  # cached there: no copy per step
    angles = positions.to(torch.float32).unsqueeze(-1) * inv
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [T, H, d]`` with half tables ``[T, 1, d/2]``; bitwise equal to
    ``core.rope.apply_rope`` for fp32 (tested) with half the ops and no concatenation."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.empty_like(xf)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).sub_(x2 * sin)
    torch.mul(x2, cos, out=o2).add_(x1 * sin)
    return out.to(x.dtype)


class Attention(nn.Module):
    """GQA self-attention; records the pre-RoPE query into the step capture when asked."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_q_heads, self.num_kv_heads = cfg.num_q_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        q_size, kv_size = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = FusedLinear(
            self,
            "qkv_proj",
            cfg.hidden_size,
            {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size},
            bias=cfg.attention_bias,
        )
        self.o_proj = nn.Linear(cfg.num_q_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.qk_norm = cfg.qk_norm
        self.backend = backend
        # View [2, num_pages, page_size, Hkv, d] of the shared cache; not a module buffer.
        self.kv_cache: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [T, hidden]``, ``cos/sin [T, 1, d/2]`` -> ``[T, hidden]``; with ``residual``
        the output projection is added to it in place (one GEMM with beta=1) and returned."""
        num_tokens, num_q = x.shape[0], self.num_q_heads
        qkv = self.qkv_proj(x).view(num_tokens, -1, self.head_dim)  # [T, Hq + 2 Hkv, d]
        q, k, v = qkv.split([num_q, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
            qk = torch.cat([q, k], dim=1)
        else:
            qk = qkv[:, : num_q + self.num_kv_heads]
        ctx = get_context()
        q_pre_rope = q
        qk = apply_rope_half(qk, cos, sin)  # q and k rotated together
        q, k = qk[:, :num_q], qk[:, num_q:]
        if ctx.capture is not None:
            ctx.capture.record(self.layer_idx, q_pre_rope, k, v)
        out = self.backend.forward(q, k, v, self.kv_cache, ctx, self.scale)
        return _linear(out.reshape(num_tokens, -1), self.o_proj, residual)


def _linear(x: torch.Tensor, proj: nn.Linear, residual: torch.Tensor | None) -> torch.Tensor:
    """``proj(x)``, or ``residual += proj(x)`` in place (bias-free ``proj``) and returned."""
    if residual is None:
        return proj(x)
    return residual.addmm_(x, proj.weight.t())


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, gate and up as one fused GEMM."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = FusedLinear(
            self,
            "gate_up_proj",
            cfg.hidden_size,
            {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size},
            bias=False,
        )
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, hidden] -> [T, hidden]``; with ``residual``, added to it in place."""
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
        hidden = nn.functional.silu(gate, inplace=True).mul_(up)  # in gate_up's own storage
        return _linear(hidden, self.down_proj, residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, layer_idx, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Updates the residual stream ``x [T, hidden]`` in place and returns it."""
        x = self.self_attn(self.input_layernorm(x), cos, sin, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        # NOTE: no random init (the weights come from a checkpoint, see ``build_model``): on the
        # meta device, nn.Embedding's normal_ alone imports torch's Python decompositions (~2 s).
        self.embed_tokens = nn.Embedding.from_pretrained(
            torch.empty(cfg.vocab_size, cfg.hidden_size), freeze=True
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def attention_layers(self) -> list[Attention]:
        """Each layer's attention module, in order (``nn.ModuleList`` does not type its items)."""
        modules = []
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            modules.append(layer.self_attn)
        return modules


class CausalLM(nn.Module):
    """Decoder with an LM head (tied to the embeddings when the config says so)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.backend = backend if backend is not None else TorchAttentionBackend()
        self.model = DecoderModel(cfg, self.backend)
        self.kv_cache: torch.Tensor | None = None  # what ``bind_kv_cache`` bound last
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the packed step tokens ``input_ids [T]`` at
        absolute ``positions [T]``; needs a step context (``use_context``)."""
        cos, sin = rope_tables(self.config.rope, positions)
        x = self.model.embed_tokens(input_ids)  # a fresh tensor: the layers add into it
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden] -> logits [N, vocab]`` in fp32."""
        weight = (
            self.model.embed_tokens.weight
            if self.config.tie_word_embeddings
            else self.lm_head.weight
        )
        return nn.functional.linear(hidden, weight).float()

    def set_backend(self, backend: AttentionBackend) -> None:
        """Install ``backend`` in the model and every attention layer."""
        self.backend = backend
        for attn in self.model.attention_layers():
            attn.backend = backend

    def bind_kv_cache(self, kv_cache: torch.Tensor | None) -> None:
        """Give each layer its view of ``kv_cache [2, L, num_pages, page_size, Hkv, d]``."""
        self.kv_cache = kv_cache
        for i, attn in enumerate(self.model.attention_layers()):
            attn.kv_cache = None if kv_cache is None else kv_cache[:, i]
