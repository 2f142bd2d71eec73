"""Reading the default model's GGUF metadata and tensor table: ``GGUFFile`` vs ``gguf.GGUFReader``.

    python benchmarks/gguf_read.py [--repeat 3] [--path model.gguf]

Both read everything ``LLM()`` needs from the file before dequantization: the metadata values
(the 49k tokens and merges of SmolLM2's tokenizer among them) and the tensor table. Runs are
interleaved and the best of ``--repeat`` is kept for each (the machine may be busy).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--path", type=Path, default=None)
    args = p.parse_args(argv)
    path = args.path or default_model_path()
    best = {"GGUFFile": float("inf"), "gguf.GGUFReader": float("inf")}
    for _ in range(args.repeat):
        for name, fn in (("GGUFFile", ours), ("gguf.GGUFReader", package)):
            start = time.perf_counter()
            fn(path)
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"{path.name}: best of {args.repeat}, interleaved")
    for name, seconds in best.items():
        print(f"  {name:16s} {seconds:7.3f} s")
    print(f"  speed-up {best['gguf.GGUFReader'] / best['GGUFFile']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
