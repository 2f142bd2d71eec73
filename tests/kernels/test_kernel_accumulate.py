"""H2O accumulated attention (``accumulate_attention``) vs the naive reference, and the sums
moving with the kept slots in ``compact_kv``."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_helpers import DEVICE, DTYPE_IDS, DTYPES, ON_CUDA, TOL, gen, make_block_tables, randn
from test_kernel_compaction import make_keep

from growpage.kernels import accumulate_attention, compact_kv, reference

NUM_KV_HEADS = 2
HEAD_DIM = 64 if ON_CUDA else 16
CASES = [  # (dtype, GQA group, page size), each dtype and group at least once
    pytest.param(dtype, group, page, id=f"{dtype_id}-gqa{group}-page{page}")
    for (dtype, dtype_id), (group, page) in zip(
        [(d, i) for d, i in zip(DTYPES, DTYPE_IDS, strict=True) for _ in range(2)],
        [(1, 4), (3, 16), (8, 4), (1, 16), (3, 4), (8, 16)],
        strict=True,
    )
]


def make_case(dtype: torch.dtype, group: int, page_size: int, seed: int = 0):
    """Ragged rows (one slot, whole pages, a partial page, an empty padding row) over shuffled
    pages; ``acc`` starts with noise, so "added" and "set" slots both show."""
    g = gen(seed)
    lens = [1, 2 * page_size, page_size + 3, 0]
    max_pages = max(-(-n // page_size) for n in lens) + 1
    num_pages = sum(-(-n // page_size) for n in lens) + 2
    q = randn(len(lens), NUM_KV_HEADS * group, HEAD_DIM, dtype=dtype, g=g)
    k_cache = randn(num_pages, page_size, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, g=g)
    tables = make_block_tables(lens, page_size, num_pages, max_pages, g)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    acc = randn(num_pages * page_size, NUM_KV_HEADS, g=g).abs()
    return q, k_cache, tables, context_lens, acc


def natural_lse(
    q: torch.Tensor, k_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    """``[B, Hq]`` log-sum-exp of each row's scaled logits (what a decode kernel would give)."""
    page_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape[:2], device=q.device)
    for b, n in enumerate(lens.tolist()):
        if n:
            k = reference.flat_cache(k_cache)[reference.token_slots(tables[b], n, page_size)]
            k = k.float().repeat_interleave(group, dim=1)  # [n, Hq, d]
            logits = torch.einsum("hd,nhd->hn", q[b].float(), k) / math.sqrt(q.shape[-1])
            out[b] = logits.logsumexp(dim=-1)
    return out


@pytest.mark.parametrize("given_lse", [False, True], ids=["recomputed-lse", "given-lse"])
@pytest.mark.parametrize(("dtype", "group", "page_size"), CASES)
def test_accumulate_matches_reference(dtype, group, page_size, given_lse) -> None:
    q, k_cache, tables, lens, acc = make_case(dtype, group, page_size)
    expected = acc.clone()
    reference.accumulate_attention(q, k_cache, tables, lens, expected)
    lse = natural_lse(q, k_cache, tables, lens) if given_lse else None
    accumulate_attention(q, k_cache, tables, lens, acc, lse=lse)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(acc, expected, atol=max(atol, 1e-5), rtol=rtol)
    # Each non-empty row adds one unit of attention per KV head (its own slot reset first).
    untouched = torch.ones(acc.shape[0], dtype=torch.bool, device=DEVICE)
    for b, n in enumerate(lens.tolist()):
        if n:
            untouched[reference.token_slots(tables[b], n, page_size)] = False
    assert torch.equal(acc[untouched], make_case(dtype, group, page_size)[4][untouched])


def test_accumulate_sums_to_one_per_step_and_sets_the_new_slot() -> None:
    """From zero sums, one step gives every row one unit per KV head; a slot holding stale
    sums (a reused page) is overwritten when it is the row's last slot."""
    q, k_cache, tables, lens, acc = make_case(torch.float32, 3, 4, seed=3)
    acc.zero_()
    last = [reference.token_slots(tables[b], n, 4)[-1] for b, n in enumerate(lens.tolist()) if n]
    acc[torch.stack(last)] = 1e6  # stale garbage of a previous owner
    accumulate_attention(q, k_cache, tables, lens, acc, sm_scale=0.3)
    expected = torch.zeros_like(acc)
    reference.accumulate_attention(q, k_cache, tables, lens, expected, sm_scale=0.3)
    torch.testing.assert_close(acc, expected, atol=1e-5, rtol=1e-5)
    assert acc.sum().item() == pytest.approx(NUM_KV_HEADS * int((lens > 0).sum()), rel=1e-5)


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_compaction_moves_the_sums_with_the_kv(staged: bool) -> None:
    """Two requests compacted in place with different kept counts: K, V and the sums agree
    with the reference (which reads everything before writing)."""
    g = gen(4)
    page_size, layers = 4, 2
    kv_cache = randn(2, layers, 7, page_size, NUM_KV_HEADS, HEAD_DIM, g=g)
    acc = randn(layers, 7 * page_size, NUM_KV_HEADS, g=g)
    tables = torch.tensor([[4, 0, 6, -1], [2, 5, 1, -1]], dtype=torch.int32, device=DEVICE)
    keep = make_keep([12, 11], [8, 5], g)
    before = acc.clone()
    expected_kv, expected_acc = kv_cache.clone(), acc.clone()
    reference.compact_kv(expected_kv, tables, keep, None, accumulated=expected_acc)
    compact_kv(kv_cache, tables, keep, None, accumulated=acc, staged=staged)
    assert torch.equal(kv_cache, expected_kv)
    assert torch.equal(acc, expected_acc)
    # Spelled out for request 0, layer 1, head 1: slot j now holds what slot keep[j] held.
    flat = reference.token_slots(tables[0], 12, page_size)
    assert torch.equal(acc[1, flat[:8], 1], before[1, flat[keep[0, 1, 1].long()], 1])


def test_compaction_into_other_pages_moves_the_sums() -> None:
    """Destination pages in another order (the staged route): sums follow their slots."""
    g = gen(5)
    page_size, layers = 4, 2
    kv_cache = randn(2, layers, 6, page_size, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, g=g)
    acc = randn(layers, 6 * page_size, NUM_KV_HEADS, g=g)
    src = torch.tensor([[3, 1, 4]], dtype=torch.int32, device=DEVICE)
    dst = torch.tensor([[4, 3, -1]], dtype=torch.int32, device=DEVICE)
    keep = make_keep([12], [8], g)
    before = acc.clone()
    expected_kv, expected_acc = kv_cache.clone(), acc.clone()
    reference.compact_kv(expected_kv, src, keep, dst, accumulated=expected_acc)
    compact_kv(kv_cache, src, keep, dst, accumulated=acc)  # auto: staged
    assert torch.equal(kv_cache, expected_kv) and torch.equal(acc, expected_acc)
    src_slots = reference.token_slots(src[0], 12, page_size)
    dst_slots = reference.token_slots(dst[0], 8, page_size)
    for layer in range(layers):
        for h in range(NUM_KV_HEADS):
            moved = before[layer, src_slots[keep[0, layer, h].long()], h]
            assert torch.equal(acc[layer, dst_slots, h], moved)
