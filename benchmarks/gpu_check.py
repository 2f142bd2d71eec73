"""GPU check in one command: kernel tests on CUDA, then the numbers issue 4 asks for.

    python benchmarks/gpu_check.py                  # one GPU, ~5 min: tests + benchmarks
    python benchmarks/gpu_check.py --smoke          # tiny shapes, CPU, Triton interpreter

Writes ``<out>.json`` and ``<out>.md`` (default ``results/gpu_check``): decode-attention
bandwidth (GB/s, % of peak) for batch {1,16,64,256} x context {1k,4k,16k} with Llama-8B-like
heads, the fused EMA cost, compaction and demand-estimation time per boundary event, and the
engine throughput hook (skipped until ``growpage.LLM`` exists).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
TARGET_BW_PCT, TARGET_EMA_PCT = 70.0, 3.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET")
    p.add_argument("--out", default="results/gpu_check", help="report path without extension")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--peak-gbps", type=float, default=None, help="peak HBM GB/s if not detected")
    p.add_argument("--skip-tests", action="store_true", help="do not run pytest tests/kernels")
    p.add_argument("--no-sweep", action="store_true", help="keep the default launch config")
    p.add_argument("--test-timeout", type=int, default=270, help="seconds for the test run")
    return p.parse_args(argv)


def ensure_kernels_importable() -> None:
    """Import growpage.kernels from the source tree when the package is not installed (device runs)."""
    sys.path.insert(0, str(ROOT))
    import growpage

    if importlib.util.find_spec("growpage.kernels") is not None:
        return
    spec = importlib.util.spec_from_file_location(
        "growpage.kernels", ROOT / "kernels" / "__init__.py",
        submodule_search_locations=[str(ROOT / "kernels")])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["growpage.kernels"] = module
    spec.loader.exec_module(module)
    growpage.kernels = module  # type: ignore[attr-defined]


def run_kernel_tests(timeout_s: int) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels",
           "-k", "not gpu_check"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"passed": False, "summary": f"timed out after {timeout_s} s", "seconds": timeout_s}
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    failures = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    return {"passed": proc.returncode == 0, "summary": lines[-1] if lines else proc.stderr[-500:],
            "failures": failures[:20], "seconds": time.perf_counter() - start}


def engine_throughput(smoke: bool) -> dict:
    """HOOK (engine integration): SmolLM2 throughput, ``fullkv`` vs ``growpage``, same page pool.

    Skipped until ``growpage.LLM`` is importable. The call below follows the planned engine API
    (nano-vllm style); adjust it here when the engine lands. Boundary work should be <= 1% of
    decode time in this run.
    """
    try:
        from growpage import LLM  # type: ignore[attr-defined]
    except ImportError as exc:
        return {"status": "skipped", "reason": f"growpage.LLM not importable yet ({exc})"}
    prompts = ["Solve step by step: what is 17 * 23 + 4?"] * (2 if smoke else 64)
    max_tokens = 8 if smoke else 512
    rows = {}
    try:
        for policy in ("fullkv", "growpage"):
            llm = LLM(policy=policy, attention_backend="triton")
            start = time.perf_counter()
            outputs = llm.generate(prompts, max_tokens=max_tokens)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outputs)
            rows[policy] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    except Exception as exc:  # the engine API is still moving: report, do not crash the check
        return {"status": "error", "reason": repr(exc)[:500], **rows}
    return {"status": "ok", **rows}


def timed(report: dict, name: str, fn, *args) -> None:
    start = time.perf_counter()
    try:
        report[name] = fn(*args)
    except Exception as exc:  # keep the other sections' numbers
        report[name] = {"error": repr(exc)[:500]}
    report.setdefault("section_seconds", {})[name] = round(time.perf_counter() - start, 2)
    print(f"[gpu_check] {name}: {report['section_seconds'][name]} s", flush=True)


def run(args: argparse.Namespace) -> dict:
    import gpu_bench
    import torch

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = getattr(torch, DTYPES[args.dtype])
    shapes = gpu_bench.SMOKE if args.smoke else gpu_bench.Shapes()
    peak = gpu_bench.peak_gbps(device, args.peak_gbps)
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "smoke": args.smoke, "dtype": args.dtype, "peak_gbps": peak,
                    "torch": torch.__version__, "shapes": shapes.__dict__}
    if args.skip_tests or args.smoke:
        report["tests"] = {"skipped": "--smoke/--skip-tests"}
    else:
        timed(report, "tests", run_kernel_tests, args.test_timeout)
    config: dict = {}
    if not args.no_sweep:
        timed(report, "sweep", gpu_bench.sweep_decode, shapes, dtype, device)
        config = report["sweep"].get("best", {})
    report["decode_config"] = config
    timed(report, "decode", gpu_bench.decode_bandwidth, shapes, dtype, device, peak, config)
    timed(report, "ema", gpu_bench.ema_overhead, shapes, dtype, device, config)
    timed(report, "boundary", gpu_bench.boundary_work, shapes, dtype, device)
    timed(report, "engine", engine_throughput, args.smoke)
    report["targets"] = check_targets(report)
    return report


def check_targets(r: dict) -> dict:
    """Issue 4 targets: bandwidth at batch >= 64 and context >= 4k; fused EMA overhead."""
    big = [row for row in r.get("decode", []) if isinstance(row, dict) and "ms" in row
           and row["batch"] >= 64 and row["context"] >= 4096]
    pcts = [row["pct_peak"] for row in big if row["pct_peak"] is not None]
    ema = [e["fused_overhead_pct"] for e in r.get("ema", [])
           if isinstance(e, dict) and "plain_ms" in e]
    return {"min_pct_peak_big": min(pcts) if pcts else None,
            "bandwidth_met": bool(pcts) and min(pcts) >= TARGET_BW_PCT,
            "max_fused_ema_overhead_pct": max(ema) if ema else None,
            "ema_met": bool(ema) and max(ema) <= TARGET_EMA_PCT}


def to_markdown(r: dict) -> str:
    lines = [f"# GPU check: {r['device']} ({r['dtype']}{', smoke' if r['smoke'] else ''})", ""]
    tests = r.get("tests", {})
    lines += [f"Kernel tests: {tests.get('summary', tests.get('skipped', tests))}", ""]
    lines += [f"Decode config: {r.get('decode_config') or 'defaults'}; peak {r['peak_gbps']} GB/s",
              "", "| batch | context | ms | GB/s | % peak |", "|---:|---:|---:|---:|---:|"]
    for row in r["decode"] if isinstance(r.get("decode"), list) else []:
        if "ms" not in row:
            lines.append(f"| {row['batch']} | {row['context']} | {row.get('skipped')} | | |")
            continue
        pct = f"{row['pct_peak']:.1f}" if row["pct_peak"] is not None else "n/a"
        lines.append(f"| {row['batch']} | {row['context']} | {row['ms']:.4f} | "
                     f"{row['gbps']:.1f} | {pct} |")
    lines += ["", f"Target: >= {TARGET_BW_PCT}% of peak at batch >= 64 and context >= 4k.", "",
              "| batch | context | plain ms | fused ms | unfused ms | fused % | unfused % |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for e in r["ema"] if isinstance(r.get("ema"), list) else []:
        lines.append(f"| {e['batch']} | {e['context']} | {e['plain_ms']:.4f} | {e['fused_ms']:.4f}"
                     f" | {e['unfused_ms']:.4f} | {e['fused_overhead_pct']:+.2f} |"
                     f" {e['unfused_overhead_pct']:+.2f} |")
    lines += ["", f"Target: fused EMA overhead <= {TARGET_EMA_PCT}%.", "", "Boundary event:", ""]
    lines += [f"- {k}: {v:.4f}" if isinstance(v, float) else f"- {k}: {v}"
              for k, v in r.get("boundary", {}).items()]
    lines += ["", f"Engine throughput: {json.dumps(r.get('engine'))}", "",
              f"Targets: {json.dumps(r.get('targets'))}", "",
              f"Section seconds: {r.get('section_seconds')}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    else:
        import torch

        if not torch.cuda.is_available():
            print("[gpu_check] no CUDA device: use --smoke for the CPU/interpreter run")
            return 2
    ensure_kernels_importable()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    start = time.perf_counter()
    report = run(args)
    report["total_seconds"] = round(time.perf_counter() - start, 2)
    out = Path(args.out)
    out = out.with_suffix("") if out.suffix in (".json", ".md") else out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    markdown = to_markdown(report)
    out.with_suffix(".md").write_text(markdown)
    print(markdown)
    print(f"[gpu_check] wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0 if report.get("tests", {}).get("passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
