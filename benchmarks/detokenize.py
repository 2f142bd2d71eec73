"""Detokenizing a growing output: a full decode after every token against the engine's
``IncrementalDetokenizer``, side by side.

Stop strings and streaming need a request's text after every token. Decoding the whole output
each time costs the square of its length; the incremental detokenizer decodes a few tokens per
step. This feeds the same SmolLM2 token ids, one at a time, to both, interleaved token by token
(so load on the machine hits both alike), checks that they give the same text, and prints the
time per token and the ratio:

    python benchmarks/detokenize.py                        # 1k and 4k tokens, ~10 s
    python benchmarks/detokenize.py --tokens 16000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from growpage.engine.detokenizer import IncrementalDetokenizer  # noqa: E402


def reasoning_ids(tokenizer, n: int) -> list[int]:
    """``n`` token ids of reasoning-like text (steps, numbers, symbols, a little non-ASCII)."""
    ids: list[int] = []
    step = 0
    while len(ids) < n:
        step += 1
        line = (
            f"Step {step}: let x_{step} = {step * step} − {step} = {step * step - step}; "
            f"so the sum ∑ so far is {step * (step + 1) // 2}, which is ≥ {step}. "
            "Check: naïve bound ✓.\n"
        )
        ids += tokenizer.encode(line, add_special_tokens=False)
    return ids[:n]


def time_both(decode, ids: list[int]) -> dict:
    """Seconds to keep the text of a growing output up to date, both ways, interleaved."""
    out: list[int] = []
    det = IncrementalDetokenizer(decode)
    full_s = incr_s = 0.0
    full = ""
    for t in ids:
        out.append(t)
        start = time.perf_counter()
        full = decode(out)
        mid = time.perf_counter()
        det.update(out)
        incr_s += time.perf_counter() - mid
        full_s += mid - start
    if det.text + det.pending != full:
        raise AssertionError(f"the two ways gave different text after {len(ids)} tokens")
    n = len(ids)
    return {
        "tokens": n,
        "full_ms_per_token": 1000 * full_s / n,
        "incremental_ms_per_token": 1000 * incr_s / n,
        "full_s": full_s,
        "incremental_s": incr_s,
        "speedup": full_s / incr_s,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[1000, 4000],
        help="output lengths to generate token by token (default 1000 4000; the full "
        "decodes take about n^2 / 4 microseconds)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    if any(n < 1 for n in args.tokens):
        p.error(f"--tokens must be >= 1, got {args.tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from growpage.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    rows = [time_both(tokenizer.decode, reasoning_ids(tokenizer, n)) for n in args.tokens]
    print("SmolLM2 tokenizer, text kept up to date after every token:\n")
    print(
        "| tokens | full decode ms/token | incremental ms/token | full s | incremental s "
        "| speedup |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['tokens']} | {r['full_ms_per_token']:.3f} | "
            f"{r['incremental_ms_per_token']:.4f} | {r['full_s']:.2f} | "
            f"{r['incremental_s']:.3f} | {r['speedup']:.0f}x |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    from script_main import run_main

    sys.exit(run_main(main))
