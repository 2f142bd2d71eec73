"""Helpers for engine tests: tiny random models built both here and in transformers, and a
minimal paged-cache driver (page allocation + step metadata) standing in for the runner."""

from __future__ import annotations

import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from growpage.core.rope import RopeConfig  # noqa: E402
from growpage.engine.loading.loader import build_model, meta_shapes  # noqa: E402
from growpage.engine.modeling.attention import allocate_kv_cache  # noqa: E402
from growpage.engine.modeling.model import CausalLM, ModelConfig  # noqa: E402
from growpage.engine.modeling.step_context import decode_context, prefill_context, use_context  # noqa: E402

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_eps=1e-6,
)
TINY_VARIANTS = {
    "llama": dict(arch="llama", tie_word_embeddings=False, qk_norm=False),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True, qk_norm=False),
    "qwen3": dict(arch="qwen3", tie_word_embeddings=False, qk_norm=True),
}


def tiny_config(variant: str, theta: float = 10000.0) -> ModelConfig:
    return ModelConfig(
        **TINY,
        **TINY_VARIANTS[variant],
        rope=RopeConfig(head_dim=TINY["head_dim"], theta=theta),
        bos_token_id=1,
        eos_token_ids=(2,),
        name=f"tiny-{variant}",
    )


def hf_config(cfg: ModelConfig):
    """The transformers config describing the same model."""
    from transformers import LlamaConfig, Qwen3Config

    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_q_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_eps,
        rope_theta=cfg.rope.theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_ids[0],
        pad_token_id=0,
        attention_bias=False,
    )
    if cfg.arch == "qwen3":
        return Qwen3Config(**kwargs)
    return LlamaConfig(**kwargs, mlp_bias=False)


def random_state_dict(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Weights large enough that attention is peaked and logits are far from uniform."""
    gen = torch.Generator().manual_seed(seed)
    shapes = meta_shapes(cfg)
    sd = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            sd[name] = 1.0 + 0.2 * torch.randn(shape, generator=gen)
        elif "embed_tokens" in name:
            sd[name] = torch.randn(shape, generator=gen)
        else:
            sd[name] = torch.randn(shape, generator=gen) * (1.5 / shape[-1] ** 0.5)
    return sd


def hf_model(cfg: ModelConfig, sd: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(
        hf_config(cfg), dtype=torch.float32, attn_implementation="eager"
    )
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def tiny_pair(variant: str, seed: int = 1234):
    """``(ours: CausalLM, reference: transformers model)`` with identical random weights."""
    cfg = tiny_config(variant)
    sd = random_state_dict(cfg, seed=seed)
    return build_model(cfg, dict(sd)), hf_model(cfg, sd)


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """Reference logits ``[T, V]`` of one sequence."""
    return model(torch.tensor([ids])).logits[0].float()


class PagedDriver:
    """Minimal stand-in for the model runner: shuffled page allocation, slot mapping, block
    tables and context per step. Sequences are identified by ints."""

    def __init__(self, model: CausalLM, num_pages: int, page_size: int, seed: int = 0) -> None:
        c = model.config
        self.model, self.page_size = model, page_size
        self.cache = allocate_kv_cache(
            c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim
        )
        model.bind_kv_cache(self.cache)
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _append_slots(self, seq: int, n: int) -> list[int]:
        table, start = self.tables.setdefault(seq, []), self.lens.get(seq, 0)
        while len(table) * self.page_size < start + n:
            table.append(self.free.pop())
        self.lens[seq] = start + n
        return [
            table[i // self.page_size] * self.page_size + i % self.page_size
            for i in range(start, start + n)
        ]

    def block_tables(self, seqs: list[int]) -> torch.Tensor:
        width = max(len(self.tables[s]) for s in seqs)
        return torch.tensor([self.tables[s] + [-1] * (width - len(self.tables[s])) for s in seqs])

    @torch.inference_mode()
    def prefill(
        self,
        chunks: dict[int, list[int]],
        use_tables: bool = True,
        capture=None,
        last_only: bool = False,
    ) -> dict[int, torch.Tensor]:
        """Run new tokens of each sequence in one packed step; logits ``[n, V]`` per seq
        (``[1, V]`` with ``last_only``)."""
        seqs, ids, positions, slots = list(chunks), [], [], []
        for s in seqs:
            start = self.lens.get(s, 0)
            slots += self._append_slots(s, len(chunks[s]))
            ids += chunks[s]
            positions += range(start, start + len(chunks[s]))
        ctx = prefill_context(
            [len(chunks[s]) for s in seqs],
            torch.tensor(slots),
            self.block_tables(seqs) if use_tables else None,
            [self.lens[s] for s in seqs],
            capture=capture,
        )
        with use_context(ctx):
            hidden = self.model(torch.tensor(ids), torch.tensor(positions))
        if last_only:
            logits = self.model.compute_logits(hidden[ctx.last_token_indices()])
            return {s: logits[i : i + 1] for i, s in enumerate(seqs)}
        logits = self.model.compute_logits(hidden)
        bounds = ctx.cu_seqlens_q.tolist()
        return {s: logits[bounds[i] : bounds[i + 1]] for i, s in enumerate(seqs)}

    @torch.inference_mode()
    def decode(self, tokens: dict[int, int], capture=None) -> dict[int, torch.Tensor]:
        """One token per sequence; next-token logits ``[V]`` per seq."""
        seqs = list(tokens)
        positions = [self.lens[s] for s in seqs]
        slots = [self._append_slots(s, 1)[0] for s in seqs]
        ctx = decode_context(
            torch.tensor(slots),
            self.block_tables(seqs),
            torch.tensor([self.lens[s] for s in seqs]),
            capture=capture,
        )
        with use_context(ctx):
            hidden = self.model(torch.tensor([tokens[s] for s in seqs]), torch.tensor(positions))
        logits = self.model.compute_logits(hidden)
        return {s: logits[i] for i, s in enumerate(seqs)}


def greedy_paged(
    model: CausalLM, prompts: list[list[int]], n: int, page_size: int = 5, num_pages: int = 512
) -> list[list[int]]:
    """Greedy continuation of each prompt, all decoded together through the paged cache."""
    drv = PagedDriver(model, num_pages, page_size, seed=7)
    last = drv.prefill({i: p for i, p in enumerate(prompts)}, last_only=True)
    out: list[list[int]] = [[] for _ in prompts]
    nxt = {i: int(last[i][-1].argmax()) for i in range(len(prompts))}
    for step in range(n):
        for i, t in nxt.items():
            out[i].append(t)
        if step == n - 1:
            break
        logits = drv.decode(nxt)
        nxt = {i: int(v.argmax()) for i, v in logits.items()}
    model.bind_kv_cache(None)
    return out
