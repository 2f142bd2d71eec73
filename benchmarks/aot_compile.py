"""Do the kernels compile for NVIDIA GPUs (sm_90, sm_80) without spills, on a machine with none?

Every kernel compiled, and read back with Triton's bundled ptxas and cuobjdump.

Catches GPU-only failures in CPU-only CI: ops the interpreter accepts but the compiler rejects,
shared memory over the device limit, and two kinds of slow code the interpreter cannot show:

* *register spills*: a kernel that needs more than 255 registers a thread keeps the rest in
  local memory (``STACK``/``LOCAL`` in cuobjdump's resource usage), which is device memory;
* *scalar KV access*: the kernels that move KV rows (``VECTOR_KERNELS``) must load them, and
  the data movers store them, in 16-byte vectors. Triton vectorizes only what it can prove
  aligned; when a stride's divisibility by 16 is lost (``_utils.stride_align``; without it
  compaction ran 22x slower on an H200), the PTX falls back to 2-byte loads and stores.

Nothing is launched; outputs are not checked here.

    python benchmarks/aot_compile.py                 # all variants, sm_90 and sm_80
    python benchmarks/aot_compile.py --quick --arch 90
    python benchmarks/aot_compile.py --json out.json # every compiled variant, with its numbers

NOTE: drives Triton runtime internals (a stand-in driver, ``JITFunction.run(warmup=True)``);
exits with 3 when those are not as expected, 1 when a kernel fails to compile or a check fails.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from script_args import parser, run_main

SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
LLAMA = dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=256)
SMOLLM = dict(num_heads=9, num_kv_heads=3, head_dim=64, page_size=16)
WIDE = dict(num_heads=16, num_kv_heads=2, head_dim=256, page_size=16)  # Gemma-like heads
NARROW = dict(num_heads=14, num_kv_heads=2, head_dim=64, page_size=32)  # Qwen2.5-0.5B-like

# Kernels that move KV rows, what their PTX must show for the 16-byte aligned caches compiled
# here, and the constexprs whose product is the KV tile a program moves at once: "loads" (no
# global load narrower than 4 bytes, and one as wide as the tile allows) or "moves" (the same
# for loads and stores: compaction and the KV store only move data). As wide as the tile
# allows: 16 bytes, or less when the tile has fewer than 16 bytes for each of the program's
# threads (SmolLM2's 3 x 64 bf16 store fills one warp's 16-byte accesses; 2 x 64 cannot).
VECTOR_KERNELS = {
    "_compact_kernel": ("moves", ("BLOCK_N", "BLOCK_D")),
    "_store_kv_kernel": ("moves", ("BLOCK_H", "BLOCK_D")),
    "_decode_attention_kernel": ("loads", ("BLOCK_N", "BLOCK_D")),
    "_accumulate_kernel": ("loads", ("BLOCK_N", "BLOCK_D")),
    "_demand_logits_kernel": ("loads", ("BLOCK_N", "BLOCK_D")),
}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def vector_bytes(c: dict) -> int:
    """The widest access a compiled variant ``c`` of a ``VECTOR_KERNELS`` kernel can make:
    16 bytes, or its KV tile's bytes per thread when fewer (the cache's dtype is the narrowest
    float among the launch's tensors)."""
    _, tile = VECTOR_KERNELS[c["kernel"]]
    elements = 1
    for name in tile:
        elements *= int(c["constexprs"][name])
    itemsize = min(_ITEMSIZE[d] for d in c["dtype"].split(",") if d in _ITEMSIZE)
    return min(16, elements * itemsize // (32 * c["num_warps"]))


# ld.global[.nc][.v2|.v4].b16, st.global.v4.b32, cp.async.cg.shared.global [a], [b], 16 ...
_ACCESS = re.compile(r"\b(ld|st)\.global(?:\.[a-z]+)*?(?:\.v(\d))?\.[bfsu](\d+)\b")
_CP_ASYNC = re.compile(
    r"\bcp\.async\.c[ag]\.shared\.global(?:\.[\w:]+)*\s+\[[^\]]*\],\s*"
    r"\[[^\]]*\],\s*(0x[0-9a-fA-F]+|\d+)"
)


def global_accesses(ptx: str) -> dict[str, int]:
    """What ``ptx`` does with global memory: the widest load and store in bytes (``cp.async``
    copies to shared memory count as loads) and how many loads and stores are narrower than 4
    bytes (a vectorized bf16 row moves 16 bytes at a time, a scalar one 2)."""
    out = {"widest_load": 0, "widest_store": 0, "narrow_loads": 0, "narrow_stores": 0}
    for op, lanes, bits in _ACCESS.findall(ptx):
        size = int(lanes or 1) * int(bits) // 8
        kind = "load" if op == "ld" else "store"
        out[f"widest_{kind}"] = max(out[f"widest_{kind}"], size)
        out[f"narrow_{kind}s"] += size < 4
    for size in _CP_ASYNC.findall(ptx):
        out["widest_load"] = max(out["widest_load"], int(size, 0))
    return out


def _cuobjdump() -> str | None:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(path) if path.exists() else None


def resource_usage(cubin: bytes) -> dict[str, int] | None:
    """Registers per thread and spilled bytes per thread (cuobjdump's STACK + LOCAL) of one
    compiled kernel; None when Triton ships no cuobjdump."""
    tool = _cuobjdump()
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run(
            [tool, "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    if found is None:
        return None
    regs, stack, local = map(int, found.groups())
    return {"registers": regs, "spill_bytes": stack + local}


def _variant(fn, args: tuple, kwargs: dict) -> dict:
    """A compiled launch's tensor dtypes and constexpr values, for the report."""
    params = list(fn.params)
    constexprs = {
        p.name: (args[i] if i < len(args) else kwargs.get(p.name, p.default))
        for i, p in enumerate(params)
        if getattr(p, "is_constexpr", False)
    }
    dtypes = sorted({str(a.dtype).replace("torch.", "") for a in args if hasattr(a, "dtype")})
    return {
        "dtype": ",".join(dtypes),
        "constexprs": {
            k: v for k, v in constexprs.items() if isinstance(v, (bool, int, float, str))
        },
    }


def compile_mode() -> bool:
    """Make the kernels compile (``TRITON_INTERPRET=0``, which must precede their import: Triton
    reads it when a kernel is decorated) and import them; False when they were already imported
    under the interpreter."""
    if "growpage.kernels" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "0"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_check import ensure_kernels_importable

    ensure_kernels_importable()
    from growpage.kernels._utils import is_interpreter

    return not is_interpreter()


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
            compiled.append(
                {
                    "kernel": self.fn.__name__,
                    "arch": arch,
                    "seconds": time.perf_counter() - start,
                    **_variant(self, args, kwargs),
                    "num_warps": kernel.metadata.num_warps,
                    "num_stages": kernel.metadata.num_stages,
                    "shared": kernel.metadata.shared,
                    **global_accesses(kernel.asm["ptx"]),
                    **(resource_usage(kernel.asm["cubin"]) or {}),
                }
            )

        return launch

    driver.set_active(CompileOnlyDriver())
    JITFunction.__getitem__ = compile_only  # type: ignore[method-assign]
    torch.cuda.get_device_properties = lambda _: type(  # type: ignore[assignment,misc]
        "Props", (), {"multi_processor_count": 132}
    )


def compile_all(quick: bool) -> None:
    import growpage.kernels as K

    for name in (
        "decode_attention",
        "kv_store",
        "compaction",
        "demand",
        "query_state",
        "boundary_queries",
        "accumulate",
    ):
        module = sys.modules[f"growpage.kernels.{name}"]
        module.check_device = lambda *_: None  # type: ignore[attr-defined]  # CPU tensors
    every = {"decode", "store", "compact", "accumulate", "demand", "queries"}
    if quick:  # bf16 at both shapes, and fp32 where its default tile differs
        cases = [
            (LLAMA, torch.bfloat16, every),
            (LLAMA, torch.float32, {"decode", "accumulate"}),
            (SMOLLM, torch.bfloat16, every),
        ]
    else:
        cases = [
            (s, d, every)
            for s in (LLAMA, SMOLLM, WIDE, NARROW)
            for d in (torch.bfloat16, torch.float16, torch.float32)
        ]
    for sh, dtype, which in cases:
        hq, hkv, dim, page = sh["num_heads"], sh["num_kv_heads"], sh["head_dim"], sh["page_size"]
        k_cache = torch.empty(8, page, hkv, dim, dtype=dtype)
        q = torch.empty(4, hq, dim, dtype=dtype)
        tables, lens = torch.zeros(4, 8, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
        ema = dict(q_pre=q, query_state=torch.empty(8, 2, hq, dim), slot_ids=lens, is_first=lens)
        if "decode" in which:
            K.paged_decode_attention(q, k_cache, k_cache, tables, lens, num_splits=4, **ema)
        if "decode" in which and not quick:
            K.paged_decode_attention(q, k_cache, k_cache, tables, lens, num_splits=1)
            K.update_query_state(q, ema["query_state"], lens, lens)
        if "store" in which:
            K.store_kv(q[:, :hkv], q[:, :hkv], k_cache, k_cache, lens)
        kv_cache = torch.empty(2, 2, 8, page, hkv, dim, dtype=dtype)
        keep = torch.zeros(1, 2, hkv, 16, dtype=torch.int32)
        sums = torch.empty(2, 8 * page, hkv)  # H2O accumulated attention, [L, slots, Hkv]
        if "compact" in which:
            K.compact_kv(kv_cache, tables[:1], keep, staged=False)
            K.compact_kv(kv_cache, tables[:1], keep, staged=False, accumulated=sums)
        if "compact" in which and not quick:
            K.compact_kv(kv_cache, tables[:1], keep, staged=True)
            K.compact_kv(kv_cache, tables[:1], keep, staged=True, accumulated=sums)
        if "accumulate" in which:
            K.accumulate_attention(q, k_cache, tables, lens, sums[0])
        if "accumulate" in which and not quick:
            K.accumulate_attention(q, k_cache, tables, lens, sums[0], lse=torch.empty(4, hq))
        if "demand" in which:
            K.demand_attention(torch.empty(2, 2, hq, dim), kv_cache[0], tables[0], 100)
        if "queries" in which:
            K.boundary_queries(
                torch.empty(2, 4, 2, hq, dim),
                torch.empty(2, 4, hq, dim),
                1,
                100,
                torch.empty(dim // 2),
            )
    if not quick:  # the launch configs gpu_check sweeps
        k_cache = torch.empty(8, 256, 8, 128, dtype=torch.bfloat16)
        q = torch.empty(4, 32, 128, dtype=torch.bfloat16)
        for block_n in (32, 64, 128):
            for warps, stages in ((4, 2), (4, 3), (8, 2), (8, 3)):
                K.paged_decode_attention(
                    q,
                    k_cache,
                    k_cache,
                    tables,
                    lens,
                    num_splits=1,
                    block_n=block_n,
                    num_warps=warps,
                    num_stages=stages,
                )


def problems(compiled: list[dict]) -> list[str]:
    """What the compiled variants break: shared memory over the device limit, register spills,
    and scalar KV access in ``VECTOR_KERNELS`` (one line each, naming the variant)."""
    out = []
    for c in compiled:
        name = (
            f"sm_{c['arch']} {c['kernel']} {c['dtype']} warps={c['num_warps']} "
            f"{_short(c['constexprs'])}"
        )
        limit = SHARED_LIMIT.get(c["arch"], 99 * 1024)
        if c["shared"] > limit:
            out.append(f"{name}: {c['shared']} B of shared memory, over the {limit} B limit")
        if c.get("spill_bytes"):
            out.append(
                f"{name}: spills {c['spill_bytes']} B a thread to local memory "
                f"({c['registers']} registers)"
            )
        if c["kernel"] not in VECTOR_KERNELS:
            continue
        rule, _ = VECTOR_KERNELS[c["kernel"]]
        kinds = ("load", "store") if rule == "moves" else ("load",)
        want = vector_bytes(c)
        for kind in kinds:
            if c[f"narrow_{kind}s"] or c[f"widest_{kind}"] < want:
                out.append(
                    f"{name}: KV {kind}s not vectorized ({c[f'narrow_{kind}s']} "
                    f"{kind}s narrower than 4 B, widest {c[f'widest_{kind}']} B of the "
                    f"{want} B the tile allows: a stride that lost its divisibility by "
                    "16, or more threads than the tile has 16-byte pieces?)"
                )
    return out


def _short(constexprs: dict) -> str:
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in constexprs.items())


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="SM versions")
    p.add_argument(
        "--quick",
        action="store_true",
        help="the default launch of each kernel, bf16 at both shapes, fp32 decode",
    )
    p.add_argument("--json", type=Path, help="write every compiled variant here")
    args = p.parse_args(argv)
    compiled: list[dict] = []
    if not compile_mode():
        print(
            "[aot_compile] growpage.kernels was imported under the interpreter: run this "
            "script in a process of its own"
        )
        return 3
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
    print(
        "| arch | kernel | dtype | warps | stages | shared B | registers | spill B | "
        "widest load B | widest store B | narrow loads | narrow stores | s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in compiled:
        print(
            f"| sm_{c['arch']} | {c['kernel']} | {c['dtype']} | {c['num_warps']} | "
            f"{c['num_stages']} | {c['shared']} | {c.get('registers', 'n/a')} | "
            f"{c.get('spill_bytes', 'n/a')} | {c['widest_load']} | {c['widest_store']} | "
            f"{c['narrow_loads']} | {c['narrow_stores']} | {c['seconds']:.2f} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(compiled, indent=1))
    if "registers" not in (compiled[0] if compiled else {}):
        print("[aot_compile] no cuobjdump in this Triton: registers and spills not checked")
    found = problems(compiled)
    if found:
        print(f"[aot_compile] {len(found)} problem(s):")
        print("\n".join(f"  {line}" for line in found))
        return 1
    print(
        f"[aot_compile] OK: {len(compiled)} kernel launches compiled for sm_{args.arch}: no "
        "spills, shared memory within the limit, KV moved in 16-byte vectors"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
