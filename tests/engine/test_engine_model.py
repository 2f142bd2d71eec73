"""The torch model against transformers on tiny random weights: dense prefill, paged prefill,
prefix-cached (chunked) prefill, batched decode, greedy generation, query capture."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import PagedDriver, greedy_paged, hf_logits, tiny_config

from growpage.core.rope import RopeConfig, apply_rope, cos_sin
from growpage.engine.modeling.model import ModelConfig
from growpage.engine.modeling.step_context import StepCapture, prefill_context, use_context

ATOL = 1e-4


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 128) for _ in range(n)]


@pytest.mark.parametrize("length", [1, 2, 7, 33])
def test_dense_prefill_matches_hf(pair, length):
    ours, ref = pair
    ids = prompt(length, seed=length)
    ours.bind_kv_cache(None)
    with use_context(prefill_context([length])), torch.inference_mode():
        logits = ours.compute_logits(ours(torch.tensor(ids), torch.arange(length)))
    expected = hf_logits(ref, ids)
    assert expected.std() > 0.5  # weights are not trivially small
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [3, 5, 16])
def test_paged_batched_prefill_matches_hf(pair, page_size):
    ours, ref = pair
    prompts = {0: prompt(23, 1), 1: prompt(1, 2), 2: prompt(11, 3)}
    for use_tables in (False, True):
        drv = PagedDriver(ours, num_pages=64, page_size=page_size, seed=page_size)
        got = drv.prefill(prompts, use_tables=use_tables)
        for s, ids in prompts.items():
            torch.testing.assert_close(got[s], hf_logits(ref, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("splits", [[8, 15], [5, 1, 17], [1] * 4 + [19]])
def test_prefix_cached_chunked_prefill_matches_hf(pair, splits):
    """Later chunks attend to the earlier chunks through the block table only."""
    ours, ref = pair
    ids = prompt(sum(splits), seed=11)
    other = prompt(9, seed=12)
    expected = hf_logits(ref, ids)
    drv = PagedDriver(ours, num_pages=64, page_size=4, seed=3)
    start = 0
    for i, n in enumerate(splits):
        chunks = {0: ids[start : start + n]}
        if i == 1:
            chunks[1] = other  # a fresh sequence batched with a continuing one
        got = drv.prefill(chunks)
        torch.testing.assert_close(got[0], expected[start : start + n], atol=ATOL, rtol=0)
        start += n
    torch.testing.assert_close(
        got.get(1, hf_logits(ref, other)), hf_logits(ref, other), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("page_size", [4, 7])
def test_batched_decode_matches_hf(pair, page_size):
    ours, ref = pair
    seqs = {0: prompt(13, 5), 1: prompt(2, 6), 2: prompt(30, 7)}
    drv = PagedDriver(ours, num_pages=128, page_size=page_size, seed=1)
    last = drv.prefill(seqs)
    nxt = {s: int(v[-1].argmax()) for s, v in last.items()}
    for _ in range(12):
        for s, t in nxt.items():
            seqs[s].append(t)
        got = drv.decode(nxt)
        for s, ids in seqs.items():
            torch.testing.assert_close(got[s], hf_logits(ref, ids)[-1], atol=ATOL, rtol=0)
        nxt = {s: int(v.argmax()) for s, v in got.items()}


def test_greedy_32_tokens_identical_to_hf_generate(pair):
    ours, ref = pair
    prompts = [prompt(9, 21), prompt(26, 22), prompt(1, 23)]
    got = greedy_paged(ours, prompts, n=32, page_size=6)
    for p, out in zip(prompts, got, strict=True):
        with torch.inference_mode():
            gen = ref.generate(
                torch.tensor([p]),
                max_new_tokens=32,
                min_new_tokens=32,
                do_sample=False,
                pad_token_id=0,
            )
        assert out == gen[0, len(p) :].tolist()


def test_decode_is_invariant_to_slot_order_per_head(pair):
    """GrowPage compaction leaves each (layer, KV head) with its own slot order; attention
    over slot order with one context length per sequence must not care."""
    ours, _ = pair
    ids = prompt(21, 31)
    drv = PagedDriver(ours, num_pages=32, page_size=4, seed=2)
    drv.prefill({0: ids[:-1]})
    before = drv.decode({0: ids[-1]})[0]
    n, table = drv.lens[0] - 1, drv.tables[0]  # the prefix; the decode rewrites slot n
    slots = torch.tensor([table[i // 4] * 4 + i % 4 for i in range(n)])
    flat = drv.cache.view(
        2, ours.config.num_layers, -1, ours.config.num_kv_heads, ours.config.head_dim
    )
    gen = torch.Generator().manual_seed(0)
    for layer in range(ours.config.num_layers):
        for head in range(ours.config.num_kv_heads):
            perm = slots[torch.randperm(n, generator=gen)]
            flat[:, layer, slots, head] = flat[:, layer, perm, head].clone()
    drv.lens[0] -= 1  # rerun the same decode step over the shuffled cache
    after = drv.decode({0: ids[-1]})[0]
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)


def test_capture_records_pre_rope_query_and_cached_keys(pair):
    ours, _ = pair
    cfg = ours.config
    ids = prompt(10, 41)
    drv = PagedDriver(ours, num_pages=16, page_size=4, seed=4)
    cap = StepCapture(layers=frozenset({0}), record_kv=True)
    drv.prefill({0: ids}, capture=cap)
    assert set(cap.queries) == {0} and set(cap.keys) == {0}
    attn = ours.model.layers[0].self_attn
    with torch.inference_mode():
        x = ours.model.layers[0].input_layernorm(ours.model.embed_tokens(torch.tensor(ids)))
        q = attn.qkv_proj(x)[:, : cfg.num_q_heads * cfg.head_dim].view(
            10, cfg.num_q_heads, cfg.head_dim
        )
        if cfg.qk_norm:
            q = attn.q_norm(q)
    torch.testing.assert_close(cap.queries[0], q)
    cos, sin = cos_sin(cfg.rope, torch.arange(10))
    torch.testing.assert_close(
        apply_rope(cap.queries[0], cos[:, None], sin[:, None]),
        apply_rope(q, cos[:, None], sin[:, None]),
    )
    table = drv.tables[0]
    slots = [table[i // 4] * 4 + i % 4 for i in range(10)]
    cached = drv.cache[:, 0].reshape(2, -1, cfg.num_kv_heads, cfg.head_dim)[:, slots]
    torch.testing.assert_close(cached[0], cap.keys[0])
    torch.testing.assert_close(cached[1], cap.values[0])


def test_model_config_validation_and_roundtrip():
    cfg = tiny_config("qwen3")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig(**{**cfg.to_dict(), "rope": cfg.rope, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="head_dim"):
        ModelConfig(**{**cfg.to_dict(), "rope": RopeConfig(head_dim=8)})
    with pytest.raises(ValueError):
        ModelConfig(**{**cfg.to_dict(), "rope": cfg.rope, "arch": "gpt2"})


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
@pytest.mark.parametrize("shape", [(5, 576), (64, 9, 64), (3, 128)])
def test_rms_norm_is_hugging_faces_expression(dtype, shape):
    """The fused forms round exactly where Hugging Face's LlamaRMSNorm does (bitwise on CPU)."""
    from growpage.engine.modeling.model import RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    norm = RMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(shape[-1], generator=gen))
    norm = norm.to(dtype)
    xf = x.float()
    expected = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    with torch.no_grad():
        got = norm(x)
    assert got.dtype == dtype and torch.equal(got, expected)
