"""Reading the default model's GGUF file: ``GGUFFile`` vs ``gguf.GGUFReader``, then the weights'
dequantization: ``growpage.engine.dequant`` vs ``gguf.quants.dequantize``.

    python benchmarks/gguf_read.py [--repeat 3] [--path model.gguf]

The first pair reads everything ``LLM()`` needs from the file before dequantization: the
metadata values (the 49k tokens and merges of SmolLM2's tokenizer among them) and the tensor
table. The second turns every tensor into fp32 (SmolLM2: 210 Q4_1 matrices, one Q8_0, the rest
fp32) and checks that both give the same bits. Runs are interleaved and the best of
``--repeat`` is kept for each (the machine may be busy).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from growpage.engine.gguf_file import GGUFFile  # noqa: E402
from growpage.engine.loader import default_model_path  # noqa: E402


def ours(path: Path) -> int:
    f = GGUFFile(path)
    return len(f.metadata) + sum(f.raw(t).size > 0 for t in f.tensors)


def package(path: Path) -> int:
    import gguf

    r = gguf.GGUFReader(str(path))
    values = [f.contents() for key, f in r.fields.items() if not key.startswith("GGUF.")]
    return len(values) + sum(t.data.size > 0 for t in r.tensors)


def dequantize_ours(f: GGUFFile) -> list:
    from growpage.engine.dequant import dequantize

    return [dequantize(f.raw(t), t.type) for t in f.tensors]


def dequantize_package(f: GGUFFile) -> list:
    import gguf

    return [
        torch.from_numpy(
            np.array(
                gguf.quants.dequantize(f.raw(t), gguf.GGMLQuantizationType(t.type)),
                dtype=np.float32,
                copy=True,
            )
        )
        for t in f.tensors
    ]


def best_of(repeat: int, pairs: tuple, *args) -> tuple[dict[str, float], dict[str, object]]:
    """Best seconds of each ``(name, fn)`` over ``repeat`` interleaved rounds, and each one's
    last result."""
    best = {name: float("inf") for name, _ in pairs}
    results = {}
    for _ in range(repeat):
        for name, fn in pairs:
            start = time.perf_counter()
            results[name] = fn(*args)
            best[name] = min(best[name], time.perf_counter() - start)
    return best, results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--path", type=Path, default=None)
    args = p.parse_args(argv)
    path = args.path or default_model_path()
    best, _ = best_of(args.repeat, (("GGUFFile", ours), ("gguf.GGUFReader", package)), path)
    print(f"{path.name}: best of {args.repeat}, interleaved\n\nmetadata and tensor table:")
    for name, seconds in best.items():
        print(f"  {name:26s} {seconds:7.3f} s")
    print(f"  speed-up {best['gguf.GGUFReader'] / best['GGUFFile']:.1f}x")
    best, out = best_of(
        args.repeat,
        (
            ("growpage.engine.dequant", dequantize_ours),
            ("gguf.quants.dequantize", dequantize_package),
        ),
        GGUFFile(path),
    )
    same = all(torch.equal(a, b) for a, b in zip(*out.values(), strict=True))
    print("\ndequantization of every tensor to fp32:")
    for name, seconds in best.items():
        print(f"  {name:26s} {seconds:7.3f} s")
    print(
        f"  speed-up {best['gguf.quants.dequantize'] / best['growpage.engine.dequant']:.1f}x, "
        f"{'the same bits' if same else 'DIFFERENT VALUES'}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    from script_main import run_main

    sys.exit(run_main(main))
