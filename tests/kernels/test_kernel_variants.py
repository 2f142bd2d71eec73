"""Compile keys of the kernels (``growpage.kernels.variants``): what varies from one launch to
the next in an engine (batch size, context lengths, split counts, candidate and kept counts,
slot numbers, table widths, addresses of sliced index tensors) never asks Triton for a new
compiled variant, so nothing compiles in the middle of a serving run."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernel_helpers import DEVICE, gen, make_block_tables, randn

from growpage.kernels import (
    KernelInputError,
    accumulate_attention,
    boundary_queries,
    compact_kv,
    demand_attention,
    demand_attention_batch,
    paged_decode_attention,
    store_kv,
    update_query_state,
)
from growpage.kernels.variants import (
    KERNELS,
    VariantLog,
    compiled_variants,
    describe,
    record_variants,
    specialization_key,
    stubbed_launches,
)

LAYERS, HQ, HKV, D, PAGE = 2, 4, 2, 16, 4


@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["y_ptr"])
def _toy_kernel(x_ptr, y_ptr, n, m, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < m)


def test_key_follows_tritons_specialization_rules() -> None:
    x = torch.zeros(64, device=DEVICE)
    y = torch.zeros(64, device=DEVICE)

    def key(x_, y_, n, m, block=16):
        return specialization_key(_toy_kernel, (x_, y_, n, m), {"BLOCK": block})

    base = key(x, y, 16, 16)
    assert key(x, y, 17, 16) == base  # n: not specialized
    assert key(x, y[1:], 16, 16) == base  # y: not specialized on alignment
    assert key(x, y, 16, 17) != base  # m: divisibility by 16 picks the variant
    assert key(x, y, 16, 1) != key(x, y, 16, 17)  # m == 1 becomes a constant
    assert key(x[1:], y, 16, 16) != base  # x: 16-byte alignment picks the variant
    assert key(x, y, 16, 16, block=32) != base  # constexpr value
    assert key(x.half(), y, 16, 16) != base  # dtype
    assert "BLOCK=16" in describe(base) and "m:i32[D]" in describe(base)


def test_recorder_sees_launches_nests_and_restores() -> None:
    keys = torch.arange(4, device=DEVICE, dtype=torch.int32)
    k = randn(4, HKV, D, g=gen(0))
    cache = torch.zeros(2, 3, PAGE, HKV, D, device=DEVICE)
    with record_variants() as outer:
        with record_variants() as inner:
            store_kv(k, k, cache[0], cache[1], keys)
        store_kv(k, k, cache[0], cache[1], keys)
    assert inner.launches == 1 and outer.launches == 2
    assert outer.counts() == {"store_kv": 1}
    assert all("run" not in kernel.__dict__ for kernel in KERNELS.values())
    store_kv(k, k, cache[0], cache[1], keys)  # unrecorded: still launches
    assert outer.launches == 2
    later = VariantLog()
    with record_variants(later):
        store_kv(k.half(), k.half(), cache[0].half(), cache[1].half(), keys)
    assert list(later.new_since(outer)) == ["store_kv"] and outer.new_since(outer) == {}


def test_stubbed_launches_run_the_wrappers_but_write_nothing_and_restore() -> None:
    k = randn(4, HKV, D, g=gen(1))
    cache = torch.zeros(2, 3, PAGE, HKV, D, device=DEVICE)
    slots = torch.arange(4, device=DEVICE, dtype=torch.int32)
    with stubbed_launches():
        store_kv(k, k, cache[0], cache[1], slots)
        assert not cache.any()
        with pytest.raises(KernelInputError, match="one slot per token"):  # checks still run
            store_kv(k, k, cache[0], cache[1], slots[:2])
    assert all("run" not in kernel.__dict__ for kernel in KERNELS.values())
    store_kv(k, k, cache[0], cache[1], slots)
    assert torch.equal(cache[0].view(-1, HKV, D)[:4], k)


def test_compiled_variants_is_empty_under_the_interpreter() -> None:
    if DEVICE.type == "cuda":
        assert set(compiled_variants()) == set(KERNELS)
    else:
        assert compiled_variants() == {}


def _sliced(values: list[int], offset: int, dtype=torch.int32) -> torch.Tensor:
    """``values`` as a slice starting ``offset`` elements into a buffer (odd addresses)."""
    buf = torch.tensor([7] * offset + values, dtype=dtype, device=DEVICE)
    return buf[offset:]


def test_decode_attention_compiles_two_variants_whatever_the_step() -> None:
    g = gen(1)
    k_cache = randn(24, PAGE, HKV, D, g=g)
    v_cache = randn(24, PAGE, HKV, D, g=g)
    state = torch.zeros(5, 2, HQ, D, device=DEVICE)
    with record_variants() as log:
        for i, (lens, splits) in enumerate(
            [
                ([3], 1),
                ([5, 9, 1], 1),
                ([17], 2),
                ([2, 30], 3),
                ([11, 4, 8, 6, 13], 5),
                ([16, 16], None),
            ]
        ):
            batch = len(lens)
            width = max(-(-n // PAGE) for n in lens) + i % 2
            tables = make_block_tables(lens, PAGE, 24, width, g)
            q = randn(batch, HQ, D, g=g)
            paged_decode_attention(
                q,
                k_cache,
                v_cache,
                _sliced(tables.flatten().tolist(), i).view(batch, width),
                _sliced(lens, i + 1),
                num_splits=splits,
                q_pre=q,
                query_state=state,
                slot_ids=_sliced(list(range(batch)), i + 2),
                is_first=_sliced([1] * batch, i + 3),
            )
    counts = log.counts()
    assert counts["decode_attention"] == 2, [describe(k) for k in log.keys["decode_attention"]]
    assert counts["merge_splits"] == 1


def test_demand_compiles_one_variant_per_kernel() -> None:
    g = gen(2)
    k_cache = randn(LAYERS, 16, PAGE, HKV, D, g=g)
    with record_variants() as log:
        for i, (num_candidates, splits) in enumerate(
            [(1, None), (5, 1), (16, 2), (33, 3), (47, 7), (60, 16)]
        ):
            pages = torch.randperm(16, generator=g)[: -(-num_candidates // PAGE) + i % 2]
            table = _sliced(pages.tolist(), i)
            queries = randn(2, LAYERS, HQ, D, g=g)
            out = demand_attention(queries, k_cache, table, num_candidates, num_splits=splits)
            assert out.shape == (2, LAYERS, HKV, num_candidates)
        for i, num_req in enumerate((2, 3)):  # batches of requests: the same two kernels
            counts = [3 + 5 * r + i for r in range(num_req)]
            rows = [
                torch.randperm(16, generator=g)[:4].tolist() + [n, 1 + r % 2]
                for r, n in enumerate(counts)
            ]
            tables = _sliced(sum(rows, []), i + 1).view(num_req, 6)
            demand_attention_batch(
                randn(num_req, 2, LAYERS, HQ, D, g=g), k_cache, tables, 4, max(counts), 2
            )
    assert log.counts() == {"demand_logits": 1, "demand_normalize": 1}, {
        name: [describe(k) for k in keys] for name, keys in log.keys.items()
    }


def test_compaction_compiles_one_variant_per_route() -> None:
    g = gen(3)
    cache = randn(2, LAYERS, 20, PAGE, HKV, D, g=g)
    with record_variants() as direct:
        for i, keep_count in enumerate([1, 3, 6, 9]):
            pages = torch.randperm(20, generator=g)[:3].tolist()
            width = 3 + i % 2
            tables = _sliced(pages + [-1] * (width - 3) + pages + [-1] * (width - 3), i)
            keep = torch.stack(
                [
                    torch.randperm(12, generator=g)[:keep_count].sort().values
                    for _ in range(LAYERS * HKV)
                ]
            ).view(LAYERS, HKV, keep_count)
            keep = _sliced(keep.flatten().tolist(), i + 1, torch.long).view(1, LAYERS, HKV, -1)
            compact_kv(
                cache,
                tables[:width].view(1, width),
                keep,
                tables[width:].view(1, width),
                staged=False,
            )
    assert direct.counts() == {"compact": 1}
    with record_variants() as staged:
        for i, keep_count in enumerate([2, 7]):
            pages = torch.randperm(20, generator=g)[:3].tolist()
            tables = torch.tensor([pages, pages[::-1]], dtype=torch.int32, device=DEVICE)
            keep = torch.arange(keep_count, device=DEVICE).expand(1, LAYERS, HKV, keep_count)
            # A small staging budget splits the layers into chunks (layer0 > 0).
            compact_kv(
                cache,
                tables[:1],
                keep.contiguous(),
                tables[1:],
                staged=True,
                max_stage_bytes=1 if i else 1 << 30,
            )
    assert staged.counts() == {"compact": 2}  # stage-out and stage-in
    assert direct.new_since(staged)  # the direct route is a third variant


def test_accumulation_compiles_one_variant_whatever_the_step() -> None:
    """Batch, context lengths, table widths and addresses vary; so does the address of the
    sums (``sums[layer]`` per layer; not always 16-byte aligned)."""
    g = gen(5)
    k_cache = randn(24, PAGE, HKV, D, g=g)
    sums = torch.zeros(LAYERS, 24 * PAGE, HKV, device=DEVICE)
    odd = torch.zeros(1 + 24 * PAGE * HKV, device=DEVICE)[1:].view(24 * PAGE, HKV)  # unaligned
    views = [sums[0], sums[1], odd]
    with record_variants() as log:
        for i, lens in enumerate([[3], [5, 9, 1], [17], [2, 30], [11, 4, 8, 6, 13]]):
            batch = len(lens)
            width = max(-(-n // PAGE) for n in lens) + i % 2
            tables = make_block_tables(lens, PAGE, 24, width, g)
            accumulate_attention(
                randn(batch, HQ, D, g=g),
                k_cache,
                _sliced(tables.flatten().tolist(), i).view(batch, width),
                _sliced(lens, i + 1),
                views[i % 3],
            )
    assert log.counts() == {"accumulate": 1}, [describe(k) for k in log.keys["accumulate"]]


def test_boundary_queries_and_store_compile_one_variant() -> None:
    g = gen(4)
    summaries = randn(LAYERS, 5, 2, HQ, D, g=g)
    current = randn(LAYERS, 5, HQ, D, g=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=DEVICE).float() / D))
    cache = torch.zeros(2, 8, PAGE, HKV, D, device=DEVICE)
    state = torch.zeros(5, 2, HQ, D, device=DEVICE)
    with record_variants() as log:
        for slot, position in [(0, 0), (1, 1), (2, 16), (3, 17), (4, 4093)]:
            boundary_queries(summaries, current, slot, position, inv_freq)
        for i, n in enumerate([1, 3, 16, 5]):
            k = randn(n, HKV, D, g=g)
            store_kv(k, k, cache[0], cache[1], _sliced(list(range(n)), i))
            rows = min(n, state.shape[0])  # distinct slots of the pool
            q = randn(rows, HQ, D, g=g)
            update_query_state(
                q, state, _sliced(list(range(rows)), i), _sliced([i % 2] * rows, i + 1)
            )
    assert log.counts() == {"boundary_queries": 1, "store_kv": 1, "update_query_state": 1}


def test_every_launched_kernel_is_listed() -> None:
    """A new kernel must join ``KERNELS``, or the recorder and the warm-up would miss it."""
    import sys

    listed = {id(k) for k in KERNELS.values()}
    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("growpage.kernels."):
            continue
        for attr, value in vars(module).items():
            if attr.endswith("_kernel") and hasattr(value, "fn") and hasattr(value, "__getitem__"):
                found.append(attr)
                assert id(value) in listed, f"{name}.{attr} is not in variants.KERNELS"
    assert len(set(found)) == len(KERNELS)


def _constexprs(log: VariantLog, name: str, *names: str) -> set[tuple]:
    return {tuple(item[2] for item in key if item[0] in names) for key in log.keys[name]}


def test_strides_left_out_of_the_key_are_still_known_multiples_of_16() -> None:
    """The cache's layer strides and the scratch strides that follow the kept and candidate
    counts stay out of the compile keys; the wrappers tell the kernels they are multiples of 16
    (ALIGN constexprs) so that their loads and stores stay vector ones. Odd counts included:
    the staging buffer and the demand scratch are padded so that it holds for any count."""
    g = gen(7)
    cache = randn(2, LAYERS, 20, PAGE, HKV, D, g=g)
    tables = torch.tensor([[0, 1, 2], [5, 4, 3]], dtype=torch.int32, device=DEVICE)
    with record_variants() as log:
        for keep_count in (3, 7):
            keep = torch.arange(keep_count, device=DEVICE).expand(1, LAYERS, HKV, keep_count)
            compact_kv(cache, tables[:1], keep.contiguous(), tables[1:], staged=True)
            compact_kv(cache, tables[:1], keep.contiguous(), tables[1:], staged=False)
        for num_candidates in (5, 37):
            table = torch.randperm(20, generator=g)[:10].to(torch.int32).to(DEVICE)
            demand_attention(randn(2, LAYERS, HQ, D, g=g), cache[0], table, num_candidates)
    routes = _constexprs(log, "compact", "READ_STAGE", "WRITE_STAGE", "CACHE_ALIGN", "STAGE_ALIGN")
    assert routes == {(False, True, 16, 16), (True, False, 16, 16), (False, False, 16, 1)}
    assert _constexprs(log, "demand_logits", "CACHE_ALIGN", "SCRATCH_ALIGN") == {(16, 16)}
    assert _constexprs(log, "demand_normalize", "SCRATCH_ALIGN") == {(16,)}
    odd = randn(2, LAYERS, 7, 3, HKV, 17, g=g)  # layer stride 714: not a multiple of 16
    with record_variants() as unaligned:
        compact_kv(
            odd,
            tables[:1, :2],
            torch.arange(4, device=DEVICE).expand(1, LAYERS, HKV, 4).contiguous(),
            staged=False,
        )
    assert _constexprs(unaligned, "compact", "CACHE_ALIGN") == {(1,)}
