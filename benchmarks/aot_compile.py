"""Compile every kernel for NVIDIA GPUs on a machine without one (Triton's bundled ptxas).

Catches GPU-only failures (ops the interpreter accepts but the compiler rejects, shared memory
over the device limit) in CPU-only CI. Nothing is launched; outputs are not checked here.

    python benchmarks/aot_compile.py                 # all variants, sm_90 and sm_80
    python benchmarks/aot_compile.py --quick --arch 90

NOTE: drives Triton runtime internals (a stand-in driver, ``JITFunction.run(warmup=True)``);
exits with 3 when those are not as expected, 1 when a kernel fails to compile.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile for real: must precede the kernel imports

import torch  # noqa: E402

SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
LLAMA = dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=256)
SMOLLM = dict(num_heads=9, num_kv_heads=3, head_dim=64, page_size=16)


def install_fake_driver(arch: int, compiled: list[dict]) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class CompileOnlyDriver:
        def get_current_device(self) -> int:
            return arch  # one entry per arch in each kernel's device cache

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

    def compile_only(self: JITFunction, grid: object):
        def launch(*args: object, **kwargs: object) -> None:
            start = time.perf_counter()
            kernel = JITFunction.run(self, *args, grid=grid, warmup=True, **kwargs)
            compiled.append({"kernel": self.fn.__name__, "arch": arch,
                             "seconds": time.perf_counter() - start,
                             "num_warps": kernel.metadata.num_warps,
                             "shared": kernel.metadata.shared})
        return launch

    driver.set_active(CompileOnlyDriver())
    JITFunction.__getitem__ = compile_only  # type: ignore[method-assign]
    torch.cuda.get_device_properties = lambda _: type(  # type: ignore[assignment,misc]
        "Props", (), {"multi_processor_count": 132})


def compile_all(quick: bool) -> None:
    import growpage.kernels as K

    for name in ("decode_attention", "kv_store", "compaction", "demand", "query_state",
                 "boundary_queries", "accumulate"):
        module = sys.modules[f"growpage.kernels.{name}"]
        module.check_device = lambda *_: None  # type: ignore[attr-defined]  # CPU tensors
    shapes = [LLAMA] if quick else [LLAMA, SMOLLM]
    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float16, torch.float32]
    for sh, dtype in [(s, d) for s in shapes for d in dtypes]:
        hq, hkv, dim, page = sh["num_heads"], sh["num_kv_heads"], sh["head_dim"], sh["page_size"]
        k_cache = torch.empty(8, page, hkv, dim, dtype=dtype)
        q = torch.empty(4, hq, dim, dtype=dtype)
        tables, lens = torch.zeros(4, 8, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
        ema = dict(q_pre=q, query_state=torch.empty(8, 2, hq, dim), slot_ids=lens, is_first=lens)
        K.paged_decode_attention(q, k_cache, k_cache, tables, lens, num_splits=4, **ema)
        if not quick:
            K.paged_decode_attention(q, k_cache, k_cache, tables, lens, num_splits=1)
            K.update_query_state(q, ema["query_state"], lens, lens)
        K.store_kv(q[:, :hkv], q[:, :hkv], k_cache, k_cache, lens)
        kv_cache = torch.empty(2, 2, 8, page, hkv, dim, dtype=dtype)
        keep = torch.zeros(1, 2, hkv, 16, dtype=torch.int32)
        K.compact_kv(kv_cache, tables[:1], keep, staged=False)
        sums = torch.empty(2, 8 * page, hkv)  # H2O accumulated attention, [L, slots, Hkv]
        K.accumulate_attention(q, k_cache, tables, lens, sums[0])
        K.compact_kv(kv_cache, tables[:1], keep, staged=False, accumulated=sums)
        if not quick:
            K.compact_kv(kv_cache, tables[:1], keep, staged=True)
            K.compact_kv(kv_cache, tables[:1], keep, staged=True, accumulated=sums)
            K.accumulate_attention(q, k_cache, tables, lens, sums[0], lse=torch.empty(4, hq))
        K.demand_attention(torch.empty(2, 2, hq, dim), kv_cache[0], tables[0], 100)
        K.boundary_queries(torch.empty(2, 4, 2, hq, dim), torch.empty(2, 4, hq, dim), 1, 100,
                           torch.empty(dim // 2))
    if not quick:  # the launch configs gpu_check sweeps
        k_cache = torch.empty(8, 256, 8, 128, dtype=torch.bfloat16)
        q = torch.empty(4, 32, 128, dtype=torch.bfloat16)
        for block_n in (32, 64, 128):
            for warps, stages in ((4, 2), (4, 3), (8, 2), (8, 3)):
                K.paged_decode_attention(q, k_cache, k_cache, tables, lens, num_splits=1,
                                         block_n=block_n, num_warps=warps, num_stages=stages)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="SM versions")
    p.add_argument("--quick", action="store_true", help="one variant per kernel")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_check import ensure_kernels_importable

    ensure_kernels_importable()
    compiled: list[dict] = []
    for arch in args.arch:
        try:
            install_fake_driver(arch, compiled)
        except (ImportError, AttributeError) as exc:
            print(f"[aot_compile] Triton internals changed, cannot compile offline: {exc!r}")
            return 3
        try:
            compile_all(args.quick)
        except Exception as exc:
            print(f"[aot_compile] sm_{arch}: compile FAILED after {len(compiled)} kernels: {exc!r}")
            return 1
    over = [c for c in compiled if c["shared"] > SHARED_LIMIT.get(c["arch"], 99 * 1024)]
    for c in compiled:
        print(f"sm_{c['arch']} {c['kernel']:<28} warps={c['num_warps']} shared={c['shared']:>6} B"
              f" {c['seconds']:.2f} s")
    if over:
        print(f"[aot_compile] shared memory over the device limit: {over}")
        return 1
    print(f"[aot_compile] OK: {len(compiled)} kernel launches compiled for sm_{args.arch}")
    return 0


if __name__ == "__main__":
    from script_main import run_main

    sys.exit(run_main(main))
