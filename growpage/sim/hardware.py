"""Hardware and model specs for the roofline cost model, with the paper's presets.

The paper (section 5.1) runs on one A100 80 GB with gpu_memory_utilization 0.9, Qwen3-8B and
DeepSeek-R1-Distill-Llama-8B in bf16, KV pages of 256 tokens.
"""

from __future__ import annotations

import attrs

from growpage.errors import ConfigError
from growpage.validators import positive_number

GIB = 1024**3  # bytes


@attrs.frozen(kw_only=True)
class HardwareSpec:
    """One accelerator."""

    name: str
    peak_flops: float = attrs.field(validator=positive_number)  # dense bf16 FLOP/s
    memory_bandwidth: float = attrs.field(validator=positive_number)  # bytes/s
    memory_bytes: float = attrs.field(validator=positive_number)  # bytes
    memory_utilization: float = 0.9  # share of memory the engine may use (vLLM default 0.9)
    activation_bytes: float = 4 * GIB  # bytes kept back for activations and workspace

    def kv_pages(self, model: ModelSpec, page_size: int) -> int:
        """KV pages of ``page_size`` tokens left after weights and activations."""
        free = (
            self.memory_bytes * self.memory_utilization - model.weight_bytes - self.activation_bytes
        )
        pages = int(free // (model.kv_bytes_per_token * page_size))
        if pages < 1:
            raise ConfigError(
                f"{model.name} does not fit on {self.name}: {free / GIB:.1f} GiB "
                "left for the KV cache"
            )
        return pages


@attrs.frozen(kw_only=True)
class ModelSpec:
    """A dense decoder-only model."""

    name: str
    num_params: float = attrs.field(validator=positive_number)
    num_layers: int = attrs.field(validator=positive_number)
    num_q_heads: int = attrs.field(validator=positive_number)
    num_kv_heads: int = attrs.field(validator=positive_number)
    head_dim: int = attrs.field(validator=positive_number)
    bytes_per_param: float = 2.0  # bf16 weights
    bytes_per_kv: float = 2.0  # bf16 KV cache

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_kv


A100_80GB = HardwareSpec(
    name="A100-SXM4-80GB", peak_flops=312e12, memory_bandwidth=2.039e12, memory_bytes=80 * GIB
)
QWEN3_8B = ModelSpec(
    name="Qwen3-8B", num_params=8.19e9, num_layers=36, num_q_heads=32, num_kv_heads=8, head_dim=128
)
R1_LLAMA_8B = ModelSpec(
    name="DeepSeek-R1-Distill-Llama-8B",
    num_params=8.03e9,
    num_layers=32,
    num_q_heads=32,
    num_kv_heads=8,
    head_dim=128,
)

PRESETS: dict[str, tuple[HardwareSpec, ModelSpec]] = {
    "a100-qwen3-8b": (A100_80GB, QWEN3_8B),
    "a100-r1-llama-8b": (A100_80GB, R1_LLAMA_8B),
}
