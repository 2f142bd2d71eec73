"""TorchAttentionBackend and PagedTorchBackend against a naive per-sequence, per-head softmax
reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from growpage.engine.modeling.attention import (
    TorchAttentionBackend,
    allocate_kv_cache,
    gather_pages,
    kv_cache_bytes,
)
from growpage.engine.modeling.attention_torch import PagedTorchBackend
from growpage.engine.modeling.step_context import decode_context, prefill_context

BACKENDS = [TorchAttentionBackend, PagedTorchBackend]


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int | None
) -> torch.Tensor:
    """``q [n, Hq, d]`` over ``k, v [c, Hkv, d]``, one head at a time, in float64."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.empty(n, hq, d, dtype=torch.float64)
    for h in range(hq):
        for i in range(n):
            last = k.shape[0] if causal_offset is None else causal_offset + i + 1
            s = k[:last, h // group].double() @ q[i, h].double() / math.sqrt(d)
            out[i, h] = torch.softmax(s, 0) @ v[:last, h // group].double()
    return out.float()


@st.composite
def paged_batches(draw):
    page_size = draw(st.integers(1, 6))
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 3]))
    lens = draw(st.lists(st.integers(1, 20), min_size=1, max_size=4))
    return page_size, hkv, group, lens, draw(st.integers(0, 2**16))


def _fill(page_size, hkv, lens, seed, d=8):
    """A cache whose sequences own shuffled pages; returns cache, tables, per-seq k and v."""
    gen = torch.Generator().manual_seed(seed)
    pages_needed = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_needed) + 2
    cache = allocate_kv_cache(1, num_pages, page_size, hkv, d)[:, 0]
    cache.normal_(generator=gen)  # garbage in unused slots must be masked out
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables, ks, vs, backend = [], [], [], TorchAttentionBackend()
    for n, p in zip(lens, pages_needed, strict=True):
        table = [order.pop() for _ in range(p)]
        k, v = torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)
        slots = torch.tensor([table[i // page_size] * page_size + i % page_size for i in range(n)])
        backend.store_kv(k, v, cache, slots)
        tables.append(table + [-1] * (max(pages_needed) - p))
        ks.append(k)
        vs.append(v)
    return cache, torch.tensor(tables), ks, vs


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
@settings(max_examples=40, deadline=None)
@given(paged_batches())
def test_decode_matches_naive(backend, batch):
    page_size, hkv, group, lens, seed = batch
    cache, tables, ks, vs = _fill(page_size, hkv, lens, seed)
    q = torch.randn(len(lens), hkv * group, 8, generator=torch.Generator().manual_seed(seed))
    ctx = decode_context(torch.full((len(lens),), -1), tables, torch.tensor(lens))
    out = backend().decode(q, cache, ctx, 8**-0.5)
    for b in range(len(lens)):
        ref = naive_attention(q[b : b + 1], ks[b], vs[b], causal_offset=None)
        torch.testing.assert_close(out[b : b + 1], ref, atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(paged_batches(), st.data())
def test_prefill_over_cached_prefix_matches_naive(batch, data):
    page_size, hkv, group, lens, seed = batch
    cache, tables, ks, vs = _fill(page_size, hkv, lens, seed)
    new = [data.draw(st.integers(1, n)) for n in lens]  # the last `new` slots are the queries
    q = torch.randn(sum(new), hkv * group, 8, generator=torch.Generator().manual_seed(seed))
    ctx = prefill_context(new, None, tables, lens)
    k_new = torch.cat([k[-m:] for k, m in zip(ks, new, strict=True)])
    v_new = torch.cat([v[-m:] for v, m in zip(vs, new, strict=True)])
    out = TorchAttentionBackend().prefill(q, k_new, v_new, cache, ctx, 8**-0.5)
    start = 0
    for b, (n, m) in enumerate(zip(lens, new, strict=True)):
        ref = naive_attention(q[start : start + m], ks[b], vs[b], causal_offset=n - m)
        torch.testing.assert_close(out[start : start + m], ref, atol=1e-5, rtol=1e-5)
        start += m


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
def test_store_kv_skips_padding_slots_and_gather_follows_block_table(backend):
    cache = allocate_kv_cache(1, 3, 2, 1, 4)[:, 0]
    k = torch.arange(12.0).view(3, 1, 4)
    backend().store_kv(k, -k, cache, torch.tensor([5, -1, 0]))
    assert torch.equal(cache[0, 2, 1], k[0]) and torch.equal(cache[1, 2, 1], -k[0])
    assert torch.equal(cache[0, 0, 0], k[2])
    assert int((cache != 0).sum()) == 2 * 2 * 4 - 2  # two rows each in k and v; k[0][0] = 0
    gk, gv = gather_pages(cache, torch.tensor([[2, 0, -1]]))
    assert gk.shape == (1, 6, 1, 4)
    assert (
        torch.equal(gk[0, 1], k[0]) and torch.equal(gk[0, 2], k[2]) and torch.equal(gv[0, 1], -k[0])
    )


def test_paged_store_kv_reuses_step_slots_across_layers_and_not_across_steps():
    """The slot check is cached per ``slot_mapping`` tensor (one per step, shared by layers)."""
    backend = PagedTorchBackend()
    caches = allocate_kv_cache(2, 3, 2, 1, 4)
    k = torch.arange(12.0).view(3, 1, 4)
    step1 = torch.tensor([5, -1, 0])
    for layer in (0, 1):
        backend.store_kv(k + layer, -k, caches[:, layer], step1)
        assert torch.equal(caches[0, layer, 2, 1], k[0] + layer)
        assert torch.equal(caches[0, layer, 0, 0], k[2] + layer)
    backend.store_kv(k[:1] + 7, k[:1], caches[:, 0], torch.tensor([3]))  # next step
    assert torch.equal(caches[0, 0, 1, 1], k[0] + 7) and torch.equal(caches[1, 0, 1, 1], k[0])
    assert torch.equal(caches[0, 0, 2, 1], k[0])  # untouched by the second step


def test_kv_cache_bytes():
    assert kv_cache_bytes(30, 16, 3, 64, torch.float16) == 2 * 30 * 16 * 3 * 64 * 2
