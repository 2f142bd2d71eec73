"""How fast do we read a GGUF file and dequantize its weights, against the ``gguf`` package?

``GGUFFile`` vs ``gguf.GGUFReader``, ``growpage.engine.loading.dequant`` vs
``gguf.quants.dequantize``, and ``load_model``'s wall time.

    python benchmarks/gguf_read.py [--repeat 3] [--path model.gguf] [--threads N] [--no-load]

The first pair reads everything ``LLM()`` needs from the file before dequantization: the
metadata values (the tokenizer's tokens and merges among them) and the tensor table. The second
turns every tensor into fp32, one tensor at a time (both results of one tensor in memory, never
the whole model twice), checks that both give the same bits, and sums the time per tensor type
(SmolLM2: 210 Q4_1 matrices, one Q8_0, the rest fp32; Qwen2.5-Coder-1.5B Q4_K_M: Q4_K, Q6_K,
F32; 0.5B: Q5_0, Q8_0, Q6_K, Q4_K, F32). Last, ``load_model(path)`` end to end (read,
dequantize, build the model), first call and best of ``--repeat``, beside the package's
dequantization time of the same tensors. Runs are interleaved and the best of ``--repeat`` kept
for each (the machine may be busy; there, ``--threads 1`` keeps torch's threads from waiting
on a core another process holds). Exit status 1 when any tensor's bits differ.
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from script_args import add_threads, parser, run_main

from growpage.engine.loading.gguf_file import GGUFFile, GGUFTensor  # noqa: E402
from growpage.engine.loading.loader import default_model_path, load_model  # noqa: E402
from growpage.errors import EngineError  # noqa: E402


def ours(path: Path) -> int:
    f = GGUFFile(path)
    return len(f.metadata) + sum(f.raw(t).size > 0 for t in f.tensors)


def package(path: Path) -> int:
    import gguf

    r = gguf.GGUFReader(str(path))
    values = [f.contents() for key, f in r.fields.items() if not key.startswith("GGUF.")]
    return len(values) + sum(t.data.size > 0 for t in r.tensors)


def dequantize_ours(f: GGUFFile, t: GGUFTensor) -> torch.Tensor:
    from growpage.engine.loading.dequant import dequantize

    return dequantize(f.raw(t), t.type)


def dequantize_package(f: GGUFFile, t: GGUFTensor) -> torch.Tensor:
    import gguf

    data = gguf.quants.dequantize(f.raw(t), gguf.GGMLQuantizationType(t.type))
    return torch.from_numpy(np.array(data, dtype=np.float32, copy=True))


def best_of(repeat: int, pairs: tuple, *args) -> tuple[dict[str, float], dict[str, object]]:
    """Best seconds of each ``(name, fn)`` over ``repeat`` interleaved rounds, and each one's
    last result."""
    best = {name: float("inf") for name, _ in pairs}
    results = {}
    for _ in range(repeat):
        for name, fn in pairs:
            results[name] = None  # free the last round's result first
            start = time.perf_counter()
            results[name] = fn(*args)
            best[name] = min(best[name], time.perf_counter() - start)
    return best, results


def compare_dequantization(path: Path, repeat: int) -> tuple[dict, dict, set[str]]:
    """Per tensor type: ``{type: [count, weights]}``, ``{type: {name: best seconds}}`` and the
    types whose bits differed anywhere."""
    import gguf

    f = GGUFFile(path)
    pairs = (
        ("growpage.engine.loading.dequant", dequantize_ours),
        ("gguf.quants.dequantize", dequantize_package),
    )
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    seconds: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(dict(pairs), 0.0))
    differ = set()
    for t in f.tensors:
        kind = gguf.GGMLQuantizationType(t.type).name
        best, out = best_of(repeat, pairs, f, t)
        a, b = out.values()
        if not torch.equal(a, b):
            differ.add(kind)
        counts[kind][0] += 1
        counts[kind][1] += a.numel()
        for name, s in best.items():
            seconds[kind][name] += s
    return counts, seconds, differ


def time_load(path: Path, repeat: int) -> tuple[float, float]:
    """``load_model(path)``: the first call's seconds and the best of ``repeat``."""
    times = []
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        model = load_model(path)
        times.append(time.perf_counter() - start)
        del model
    return times[0], min(times)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--path", type=Path, default=None)
    p.add_argument("--no-load", action="store_true", help="skip timing load_model")
    add_threads(p, None)
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = args.path or default_model_path()
    print(
        f"{path.name}: best of {args.repeat}, interleaved; torch threads {torch.get_num_threads()}"
    )
    best, _ = best_of(args.repeat, (("GGUFFile", ours), ("gguf.GGUFReader", package)), path)
    print("\nmetadata and tensor table:")
    for name, seconds in best.items():
        print(f"  {name:26s} {seconds:7.3f} s")
    print(f"  speed-up {best['gguf.GGUFReader'] / best['GGUFFile']:.1f}x")

    counts, seconds, differ = compare_dequantization(path, args.repeat)
    print("\ndequantization to fp32, tensor by tensor (seconds summed per type):")
    print(f"  {'type':6s} {'tensors':>7s} {'weights':>13s} {'ours s':>8s} {'gguf s':>8s}  bits")
    total = {"growpage.engine.loading.dequant": 0.0, "gguf.quants.dequantize": 0.0}
    for kind, (num, weights) in sorted(counts.items()):
        s_ours, s_pkg = seconds[kind].values()
        total["growpage.engine.loading.dequant"] += s_ours
        total["gguf.quants.dequantize"] += s_pkg
        same = "DIFFERENT" if kind in differ else "same"
        print(f"  {kind:6s} {num:7d} {weights:13,d} {s_ours:8.3f} {s_pkg:8.3f}  {same}")
    ours_s, pkg_s = total.values()
    print(
        f"  all    {sum(c[0] for c in counts.values()):7d} "
        f"{sum(c[1] for c in counts.values()):13,d} {ours_s:8.3f} {pkg_s:8.3f}  "
        f"speed-up {pkg_s / ours_s:.1f}x, {'DIFFERENT VALUES' if differ else 'the same bits'}"
    )
    if not args.no_load:
        try:
            first, best_load = time_load(path, args.repeat)
        except EngineError as exc:  # tensors without a model (the tests' file of every kind)
            print(f"\nload_model(path): not a model this engine loads ({exc})")
        else:
            print(
                f"\nload_model(path): first call {first:.2f} s, best {best_load:.2f} s "
                f"(gguf.quants.dequantize of the same tensors alone: {pkg_s:.2f} s)"
            )
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
