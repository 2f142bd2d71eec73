"""Without a GPU, every kernel still compiles for sm_90 (catches what the interpreter accepts),
and the compiled code is checked for register spills and for KV rows moved in 16-byte vectors.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kernel_helpers import ON_CUDA

from growpage.kernels._utils import default_block_n, tile_warps, vector_warps

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "aot_compile.py"
NOT_ON_CUDA = pytest.mark.skipif(
    ON_CUDA, reason="on a GPU the other kernel tests compile and run for real"
)


def _aot():
    """The script as a module, for its PTX and report functions (importing it compiles
    nothing: only its ``main`` switches the kernels to compiling)."""
    spec = importlib.util.spec_from_file_location("aot_compile_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code] if code is not None else [sys.executable, str(SCRIPT), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    return proc


@NOT_ON_CUDA
def test_kernels_compile_for_sm90_without_spills_and_with_vector_access() -> None:
    proc = _run("--quick", "--arch", "90")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| sm_90 ")]
    for kernel in (
        "_decode_attention_kernel",
        "_merge_splits_kernel",
        "_store_kv_kernel",
        "_compact_kernel",
        "_demand_logits_kernel",
        "_demand_normalize_kernel",
        "_accumulate_kernel",
        "_boundary_queries_kernel",
    ):
        assert any(f"| {kernel} |" in row for row in rows), kernel
    assert "no spills, shared memory within the limit, KV moved in 16-byte vectors" in proc.stdout
    # the quick set includes the fp32 cache and the 3-KV-head store whose defaults changed
    assert any("| _decode_attention_kernel | float32,int32 |" in row for row in rows)
    assert any("| _store_kv_kernel | bfloat16,int32 | 1 |" in row for row in rows)


@NOT_ON_CUDA
def test_lost_stride_alignment_is_reported() -> None:
    """With the cache strides' divisibility by 16 hidden from Triton (what ``stride_align``
    prevents; 22x slower compaction on an H200), compaction moves KV in 2-byte pieces, and
    spills."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(SCRIPT.parent)!r})
        import torch, aot_compile as A
        assert A.compile_mode(), "kernels imported under the interpreter"
        import growpage.kernels as K
        from growpage.kernels import compaction
        compaction.check_device = lambda *_: None
        compaction.stride_align = lambda *strides: 1   # the regression
        compiled = []
        A.install_fake_driver(90, compiled)
        kv = torch.empty(2, 2, 8, 256, 8, 128, dtype=torch.bfloat16)
        K.compact_kv(kv, torch.zeros(1, 8, dtype=torch.int32),
                     torch.zeros(1, 2, 8, 16, dtype=torch.int32), staged=False)
        print("\\n".join(A.problems(compiled)))
    """)
    proc = _run(code=code)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "_compact_kernel bfloat16,int32" in proc.stdout
    assert "KV loads not vectorized" in proc.stdout
    assert "KV stores not vectorized" in proc.stdout


PTX = """
    ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    @%p1 ld.global.nc.b16 { %rs1 }, [ %rd2 + 0 ];
    st.global.v2.b32 [ %rd3 + 0 ], { %r5, %r6 };
    @%p2 st.global.b16 [ %rd4 + 0 ], { %rs2 };
    st.global.b32 [ %rd5 + 0 ], %r7;
"""
PTX_ASYNC = """
    @%p16 cp.async.ca.shared.global [ %r332 + 0 ], [ %rd59 + 0 ], 0x4, %r333;
    cp.async.cg.shared.global [ %r334 + 0 ], [ %rd60 + 0 ], 0x10, %r343;
    cp.async.commit_group;
    ld.global.b32 %r1, [ %rd1 + 0 ];
"""


def test_global_accesses_reads_widths_from_ptx() -> None:
    aot = _aot()
    assert aot.global_accesses(PTX) == {
        "widest_load": 16,
        "widest_store": 8,
        "narrow_loads": 1,
        "narrow_stores": 1,
    }
    # copies to shared memory are loads; their size is an operand (hex)
    assert aot.global_accesses(PTX_ASYNC) == {
        "widest_load": 16,
        "widest_store": 0,
        "narrow_loads": 0,
        "narrow_stores": 0,
    }
    assert aot.global_accesses("") == {
        "widest_load": 0,
        "widest_store": 0,
        "narrow_loads": 0,
        "narrow_stores": 0,
    }


def _variant(kernel: str, **numbers) -> dict:
    base = {
        "kernel": kernel,
        "arch": 90,
        "dtype": "bfloat16",
        "num_warps": 4,
        "constexprs": {"BLOCK_N": 64, "BLOCK_H": 8, "BLOCK_D": 128},
        "shared": 0,
        "registers": 96,
        "spill_bytes": 0,
        "widest_load": 16,
        "widest_store": 16,
        "narrow_loads": 0,
        "narrow_stores": 0,
    }
    return {**base, **numbers}


def test_problems_names_each_broken_rule() -> None:
    aot = _aot()
    assert (
        aot.problems([_variant("_compact_kernel"), _variant("_merge_splits_kernel", widest_load=4)])
        == []
    )
    found = aot.problems(
        [
            _variant("_decode_attention_kernel", spill_bytes=608, registers=255),
            _variant("_compact_kernel", widest_store=2, narrow_stores=128),
            _variant("_decode_attention_kernel", narrow_stores=16),  # output rows: not checked
            _variant("_demand_logits_kernel", widest_load=4),
            _variant("_boundary_queries_kernel", shared=300 * 1024),
        ]
    )
    assert len(found) == 4, found
    assert (
        "_decode_attention_kernel bfloat16 warps=4 BLOCK_N=64,BLOCK_H=8,BLOCK_D=128: spills "
        "608 B" in found[0]
    )
    assert "_compact_kernel" in found[1] and "KV stores not vectorized" in found[1]
    assert "_demand_logits_kernel" in found[2] and "KV loads not vectorized" in found[2]
    assert "_boundary_queries_kernel" in found[3] and "over the" in found[3]


def test_default_tiles_keep_bf16_and_shrink_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    from growpage.kernels import _utils

    monkeypatch.setattr(_utils, "_INTERPRETER", False)  # the compiled path's choice
    assert default_block_n(128, torch.bfloat16) == 64  # what the H200 measured at 89-94%
    assert default_block_n(64, torch.float16) == 64
    assert default_block_n(128, torch.float32) == 16
    assert default_block_n(64, torch.float32) == 32
    assert default_block_n(256, torch.bfloat16) == 32
    assert default_block_n(256, torch.float32) == 16  # never below a dot's 16 rows
    # demand attention's fp32 path takes the bf16 tile's key count (twice its bytes)
    assert default_block_n(128, torch.float32, fp32_tile_bytes=2 * _utils.TILE_BYTES) == 64
    assert default_block_n(256, torch.float32, fp32_tile_bytes=2 * _utils.TILE_BYTES) == 32
    monkeypatch.setattr(_utils, "_INTERPRETER", True)
    assert default_block_n(128, torch.bfloat16) == 16


def test_vector_warps_give_each_thread_16_bytes() -> None:
    assert vector_warps(4 * 64, 2) == 1  # SmolLM2's store: 3 (of 4) heads x 64, bf16
    assert vector_warps(8 * 128, 2) == 4  # Llama's: 8 heads x 128
    assert vector_warps(8 * 128, 4) == 4  # capped at 4
    assert vector_warps(4 * 64, 4) == 2
    assert vector_warps(2 * 16, 2) == 1  # never 0
    for elements, itemsize in ((256, 2), (1024, 2), (256, 4), (2048, 4)):
        per_thread = elements * itemsize / (32 * vector_warps(elements, itemsize))
        assert per_thread >= 16


def test_a_tile_too_small_for_16_bytes_a_thread_asks_for_what_it_allows() -> None:
    """2 KV heads of 64 bf16 values are 256 bytes: one warp's 32 threads get 8 each, so an
    8-byte store is the best there is, and a 4-byte one is still reported."""
    aot = _aot()
    small = {"BLOCK_H": 2, "BLOCK_D": 64}
    ok = _variant("_store_kv_kernel", num_warps=1, constexprs=small, widest_load=8, widest_store=8)
    assert aot.vector_bytes(ok) == 8 and aot.problems([ok]) == []
    worse = {**ok, "widest_store": 4}
    (line,) = aot.problems([worse])
    assert "KV stores not vectorized" in line and "widest 4 B of the 8 B the tile allows" in line
    # an fp32 launch of the same tile allows 16 bytes again
    assert aot.vector_bytes({**ok, "dtype": "float32,int32"}) == 16


def test_tile_warps_double_only_past_the_register_budget() -> None:
    assert tile_warps(64, 128, torch.bfloat16) == 4
    assert tile_warps(16, 128, torch.float32) == 4
    assert tile_warps(16, 256, torch.float32) == 8  # over budget even at the smallest tile
    assert tile_warps(64, 256, torch.bfloat16) == 8
