"""Bad input a caller of the launch wrappers can pass: each is refused on the host, before any
launch, by a message that names the argument (the index-value checks are elsewhere:
``test_kernel_index_checks.py``). Device mismatches use the ``meta`` device, which every
machine has; the wrappers must refuse it before any kernel or value check touches it."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, gen, randn

from growpage.kernels import (
    accumulate_attention,
    compact_kv,
    demand_attention,
    demand_attention_batch,
    paged_decode_attention,
    reference,
    store_kv,
    update_query_state,
)

D = 16
META = torch.device("meta")


def ints(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def decode_case() -> tuple[torch.Tensor, ...]:
    g = gen(40)
    q = randn(2, 4, D, g=g)
    k_cache, v_cache = randn(4, 4, 2, D, g=g), randn(4, 4, 2, D, g=g)
    return q, k_cache, v_cache, ints([[0, 1], [2, 3]]), ints([5, 8])


# --- query-state flags ------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_a_strided_is_first_is_refused(fused: bool) -> None:
    """The kernels read ``is_first[b]`` at offset b: a strided view used to be read as if dense
    (rows took the flags of other entries), a silently wrong EMA."""
    q, k_cache, v_cache, tables, lens = decode_case()
    state = torch.full((3, 2, 4, D), 5.0, device=DEVICE)
    before = state.clone()
    flags = ints([0, 1, 0, 1])[::2]  # [0, 0], every second entry of a wider tensor
    with pytest.raises(AssertionError, match="is_first: must be contiguous, got stride 2"):
        if fused:
            paged_decode_attention(
                q,
                k_cache,
                v_cache,
                tables,
                lens,
                q_pre=q,
                query_state=state,
                slot_ids=ints([0, 1]),
                is_first=flags,
            )
        else:
            update_query_state(q, state, ints([0, 1]), flags)
    assert torch.equal(state, before)
    update_query_state(q, state, ints([0, 1]), flags.contiguous())  # the same flags, dense
    reference.update_query_state(q, before, ints([0, 1]), flags)
    torch.testing.assert_close(state, before)


def test_a_strided_bool_is_first_is_converted() -> None:
    q = randn(2, 4, D, g=gen(41))
    state, expected = torch.zeros(3, 2, 4, D, device=DEVICE), torch.zeros(3, 2, 4, D, device=DEVICE)
    flags = torch.tensor([True, False, True, False], device=DEVICE)[::2]
    update_query_state(q, state, ints([2, 0]), flags)  # a bool one is copied to int32: dense
    reference.update_query_state(q, expected, ints([2, 0]), flags)
    torch.testing.assert_close(state, expected)


def test_decode_ema_tensors_on_another_device_are_refused() -> None:
    """The four EMA tensors were checked against each other but not against ``q``."""
    q, k_cache, v_cache, tables, lens = decode_case()
    with pytest.raises(AssertionError, match="tensors on different devices"):
        paged_decode_attention(
            q,
            k_cache,
            v_cache,
            tables,
            lens,
            q_pre=q.to(META),
            query_state=torch.zeros(3, 2, 4, D, device=META),
            slot_ids=ints([0, 1]).to(META),
            is_first=ints([1, 1]).to(META),
        )


# --- tensors the kernels write ----------------------------------------------------------------


def test_written_tensors_may_not_alias_themselves() -> None:
    """An expanded view (stride 0) has one address for many elements: two programs would write
    it concurrently. torch refuses such in-place writes; the wrappers used to launch."""
    q, k_cache, v_cache, tables, lens = decode_case()
    out = torch.zeros(4, D, device=DEVICE).expand(2, 4, D)
    with pytest.raises(AssertionError, match=r"out: written, so no element may alias another"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, out=out)
    cache = torch.zeros(1, 4, 2, D, device=DEVICE).expand(4, 4, 2, D)
    with pytest.raises(AssertionError, match=r"k_cache: written, .* strides \(0, 32, 16, 1\)"):
        store_kv(q[:, :2], q[:, 2:], cache, cache, ints([0, 5]))
    state = torch.zeros(1, 2, 4, D, device=DEVICE).expand(3, 2, 4, D)
    with pytest.raises(AssertionError, match="state: written"):
        update_query_state(q, state, ints([0, 1]), ints([1, 1]))
    acc = torch.zeros(1, 2, device=DEVICE).expand(16, 2)
    with pytest.raises(AssertionError, match="acc: written"):
        accumulate_attention(q, k_cache, tables, lens, acc)
    kv_cache = torch.zeros(2, 1, 1, 2, 1, D, device=DEVICE).expand(2, 1, 6, 2, 1, D)
    keep = ints([[0, 2], [1, -1]])[:, None, None]
    with pytest.raises(AssertionError, match="kv_cache: written"):
        compact_kv(kv_cache, ints([[0, 1], [2, 3]]), keep)
    sums = torch.zeros(1, 1, 1, device=DEVICE).expand(1, 12, 1)
    with pytest.raises(AssertionError, match="accumulated: written"):
        compact_kv(
            torch.zeros(2, 1, 6, 2, 1, D, device=DEVICE),
            ints([[0, 1], [2, 3]]),
            keep,
            accumulated=sums,
        )


def test_a_size_one_dimension_may_have_stride_0() -> None:
    """Only an aliased element is refused: ``expand`` of a size-1 dimension to size 1 is fine."""
    q, k_cache, v_cache, tables, lens = decode_case()
    row = q[:1]
    one = torch.zeros(1, 4, D, device=DEVICE).as_strided((1, 4, D), (0, D, 1))
    paged_decode_attention(row, k_cache, v_cache, tables[:1], lens[:1], out=one)
    expected = reference.paged_decode_attention(row, k_cache, v_cache, tables[:1], lens[:1])
    torch.testing.assert_close(one, expected, atol=2e-5, rtol=1e-5)


def test_v_cache_layout_names_both_layouts() -> None:
    q, k_cache, _, tables, lens = decode_case()
    v_cache = randn(4, 4, D, 2, g=gen(42)).transpose(2, 3)  # same shape, other strides
    with pytest.raises(
        AssertionError,
        match=r"v_cache: expected k_cache's shape \(4, 4, 2, 16\) "
        r"and strides \(128, 32, 16, 1\), got \(4, 4, 2, 16\) "
        r"and \(128, 32, 1, 2\)",
    ):
        paged_decode_attention(q, k_cache, v_cache, tables, lens)
    with pytest.raises(AssertionError, match="v_cache: expected k_cache's shape"):
        store_kv(q[:, :2], q[:, 2:], k_cache, k_cache[0], ints([0, 5]))


# --- ranks and counts of compaction and demand ------------------------------------------------


def test_compact_kv_names_a_bad_rank_and_row_counts() -> None:
    """A cache without its K/V axis used to fail unpacking its shape (``ValueError: not enough
    values to unpack``); a destination table with too few rows, with an empty message."""
    kv_cache = torch.zeros(2, 1, 6, 2, 1, D, device=DEVICE)
    tables, keep = ints([[0, 1], [2, 3]]), ints([[0, 2], [1, -1]])[:, None, None]
    with pytest.raises(
        AssertionError,
        match=r"kv_cache: expected \[2, L, num_pages, page_size, "
        r"Hkv, d\], got shape \(1, 6, 2, 1, 16\)",
    ):
        compact_kv(kv_cache[0], tables, keep)
    with pytest.raises(AssertionError, match="dst_block_tables: 1 rows, keep has 2 requests"):
        compact_kv(kv_cache, tables, keep, ints([[4, 5]]))
    with pytest.raises(AssertionError, match="block_tables: 1 rows, keep has 2 requests"):
        compact_kv(kv_cache, tables[:1], keep)
    with pytest.raises(AssertionError, match=r"keep: expected \[R, L=1, Hkv=1, K\]"):
        compact_kv(kv_cache, tables, keep.expand(2, 2, 1, 2))
    for dtype in (torch.float64, torch.int32):  # a KV cache, as every other wrapper's
        with pytest.raises(ValueError, match=f"kv_cache: fp32/fp16/bf16 expected, got {dtype}"):
            compact_kv(kv_cache.to(dtype), tables, keep)
    assert torch.equal(kv_cache, torch.zeros_like(kv_cache))


def test_demand_names_a_bad_rank_and_out_of_range_counts() -> None:
    g = gen(43)
    queries, k_cache, table = randn(2, 1, 4, D, g=g), randn(1, 4, 4, 2, D, g=g), ints([0, 1, 2])
    with pytest.raises(AssertionError, match=r"queries: expected \[V, L, Hq, d\], got shape"):
        demand_attention(queries[0], k_cache, table, 5)
    with pytest.raises(
        AssertionError,
        match=r"k_cache: expected \[L, num_pages, page_size, Hkv, "
        r"d\] \(all layers' keys\), got shape \(4, 4, 2, 16\)",
    ):
        demand_attention(queries, k_cache[0], table, 5)  # one layer's view
    with pytest.raises(
        AssertionError,
        match=r"num_candidates must lie in \[1, 12\] \(block_table "
        r"width 3 x page size 4\), got 13",
    ):
        demand_attention(queries, k_cache, table, 13)
    with pytest.raises(AssertionError, match=r"num_splits must lie in \[1, \d+\], got 0"):
        demand_attention(queries, k_cache, table, 5, num_splits=0)
    with pytest.raises(AssertionError, match="the same layer count L and head dim d"):
        demand_attention(randn(2, 1, 4, 8, g=g), k_cache, table, 5)
    tables = ints([[0, 1, 2, 5, 1]])
    with pytest.raises(AssertionError, match=r"queries: expected \[R, V, L, Hq, d\]"):
        demand_attention_batch(queries, k_cache, tables, 3, 5, 1)
    with pytest.raises(AssertionError, match="meta_col must be >= 0, got -1"):
        demand_attention_batch(queries[None], k_cache, tables, -1, 5, 1)
    with pytest.raises(AssertionError, match=r"max_candidates must lie in \[1, 12\] .*, got 13"):
        demand_attention_batch(queries[None], k_cache, tables, 3, 13, 1)


OPTIMIZED = """
import sys

import torch
from growpage.kernels import paged_decode_attention, store_kv

assert False, "this line must be stripped by -O"
torch.set_default_device(sys.argv[1])                  # the tests' device: CPU or CUDA
q = torch.zeros(1, 2, 8)
k_cache = torch.zeros(2, 4, 1, 16)                     # head dim 16 against q's 8
lens, table = torch.tensor([3], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32)
try:
    paged_decode_attention(q, k_cache, k_cache.clone(), table, lens)
except ValueError as exc:
    print("refused:", exc)
try:
    store_kv(torch.zeros(1, 1, 16, dtype=torch.float64), torch.zeros(1, 1, 16), k_cache,
             k_cache.clone(), torch.tensor([0]))
except ValueError as exc:
    print("refused:", exc)
"""


def test_checks_survive_python_dash_o(tmp_path):
    """The shape, dtype and stride checks are raised, not asserted: ``python -O`` would strip
    an ``assert``, and a bad shape would reach a kernel that reads past its tensors."""
    import subprocess
    import sys

    script = tmp_path / "optimized.py"
    script.write_text(OPTIMIZED)
    proc = subprocess.run(
        [sys.executable, "-O", str(script), str(DEVICE)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines == [
        "refused: head dim: q has 8, the cache 16",
        "refused: key: fp32/fp16/bf16 expected, got torch.float64",
    ], proc.stdout


def test_no_wrapper_checks_by_assert():
    """Every check in the kernel modules is raised (a parse of the sources: an ``assert`` there
    would be gone under ``python -O``)."""
    import ast
    from pathlib import Path

    import growpage.kernels as kernels

    root = Path(kernels.__file__).parent
    found = [
        f"{path.name}:{node.lineno}"
        for path in sorted(root.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assert)
    ]
    assert found == []


def test_kernel_input_error_is_a_value_error_and_an_assertion_error():
    from growpage.kernels import KernelInputError

    q, k_cache, v_cache, table, lens = decode_case()[:5]
    for caught in (KernelInputError, ValueError, AssertionError):
        with pytest.raises(caught, match="head dim"):
            paged_decode_attention(q[..., :8].contiguous(), k_cache, v_cache, table, lens)
