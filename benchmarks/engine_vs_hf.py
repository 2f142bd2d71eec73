"""How fast is the engine (fullkv) against Hugging Face ``generate``, at batch 1 and 16 on CPU?

Same model weights, same chat prompts, greedy, fp32. Two modes: ``fixed`` makes every request
exactly ``--max-tokens`` long (EOS ignored on our side, ``min_new_tokens`` on HF's); ``eos``
stops each request at its end-of-turn token (capped at ``--max-tokens``): the engine retires
finished requests at once, HF's batch decodes until its longest row ends. ``serve`` is ``eos``
with ``--serve-factor`` (4) times as many prompts as the batch size: the engine keeps ``batch``
requests running and admits the next one as soon as one ends (continuous batching, as a server
does), HF runs the prompts in consecutive static batches of ``batch``. Output tokens/s counts
only real output tokens. Prints a table; not a test.

    python benchmarks/engine_vs_hf.py [--threads 1] [--batch-sizes 1,16] [--max-tokens 64]
        [--model PATH] [--modes fixed eos serve] [--repeats 1]

Without ``--model``: SmolLM2-135M-Instruct, the HF model built from our loaded state dict, both
in this process. With ``--model PATH`` (a GGUF file, e.g. Qwen2.5-Coder-1.5B-Instruct): each
side runs in its own child process, one after the other, so that each one's peak memory (RSS,
model load included) is its own: the engine loads the file with ``LLM(PATH)``, transformers
with ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=float32)`` (its own
reader and dequantization; needs the ``accelerate`` package), and both decode the same token
ids. This mode also reports decode tokens/s of ``fixed``: the tokens after each request's first
over the time after a one-token run of the same batch (prefill and first token), and writes
``results/engine_vs_hf/<file stem>.json``.

On a shared CPU use one thread: with two, a core taken by another process stalls every GEMM.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from script_args import ROOT, add_out, add_threads, parser, run_main

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from growpage.core.traces import atomic_write  # noqa: E402
from growpage.engine.llm import LLM  # noqa: E402
from growpage.engine.sampling_params import SamplingParams  # noqa: E402
from growpage.errors import EngineError  # noqa: E402

QUESTIONS = [
    "What is 2+2?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain photosynthesis in one sentence.",
    "List four kinds of fruit.",
    "How many legs does a spider have?",
    "What does a CPU do?",
    "Give me a fun fact about cats.",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water?",
    "Describe a rainbow.",
    "What is gravity?",
    "Suggest a name for a pet fish.",
    "Why do we sleep?",
]


def hf_model_from(llm: LLM):
    """A transformers ``LlamaForCausalLM`` with our loaded weights (sdpa attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = llm.model.config
    cfg = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_q_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_eps,
        rope_theta=c.rope.theta,
        tie_word_embeddings=c.tie_word_embeddings,
        max_position_embeddings=c.max_position,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_ids[0],
        pad_token_id=0,
        attention_bias=False,
        mlp_bias=False,
    )
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(llm.model.state_dict(), strict=False)
    model.tie_weights()
    return model.eval()


def run_ours(
    llm: LLM, prompts: list[list[int]], max_tokens: int, fixed: bool
) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=fixed)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.token_ids for o in outs]


@torch.inference_mode()
def run_hf(
    model, prompts: list[list[int]], max_tokens: int, fixed: bool, eos: list[int]
) -> tuple[float, list[list[int]]]:
    """HF ``generate`` on the left-padded batch; rows cut after their first end token."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    extra = {"min_new_tokens": max_tokens} if fixed else {"eos_token_id": eos}
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
        **extra,
    )
    seconds = time.perf_counter() - start
    rows = out[:, width:].tolist()
    return seconds, rows if fixed else [_cut(r, set(eos)) for r in rows]


def _cut(tokens: list[int], eos: set[int]) -> list[int]:
    n = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:n]


def _agree(ours: list[list[int]], theirs: list[list[int]], eos: set[int]) -> bool:
    """Token-identical up to our first end token (with ``min_new_tokens`` HF may not end)."""
    for a, b in zip(ours, theirs, strict=True):
        n = next((i for i, t in enumerate(a) if t in eos), len(a))
        if a[:n] != b[:n]:
            return False
    return True


def run_hf_batches(
    model, prompts: list[list[int]], batch: int, max_tokens: int, fixed: bool, eos: list[int]
) -> tuple[float, list[list[int]]]:
    """``run_hf`` over consecutive static batches of ``batch`` prompts."""
    seconds, rows = 0.0, []
    for i in range(0, len(prompts), batch):
        t, out = run_hf(model, prompts[i : i + batch], max_tokens, fixed, eos)
        seconds += t
        rows += out
    return seconds, rows


def measure(
    llm: LLM, hf, batch: int, max_tokens: int, mode: str, repeats: int, serve_factor: int = 4
) -> tuple:
    """``(batch, mode, engine tok/s, HF tok/s, ratio, outputs agree)``."""
    fixed = mode == "fixed"
    num = batch * serve_factor if mode == "serve" else batch
    prompts = [llm.tokenizer.encode_chat(QUESTIONS[i % len(QUESTIONS)]) for i in range(num)]
    eos = sorted(set(llm.model.config.eos_token_ids))
    engine = (
        llm
        if mode != "serve"
        else LLM(
            llm.model,
            policy="fullkv",
            tokenizer=llm.tokenizer,
            page_size=llm.config.page_size,
            kv_pages=llm.engine.kv.num_pages,
            max_num_seqs=batch,
            enable_prefix_caching=False,
        )
    )
    ours = [run_ours(engine, prompts, max_tokens, fixed) for _ in range(repeats)]
    theirs = [run_hf_batches(hf, prompts, batch, max_tokens, fixed, eos) for _ in range(repeats)]
    t_ours, out_ours = min(ours, key=lambda r: r[0])
    t_hf, out_hf = min(theirs, key=lambda r: r[0])
    n_ours, n_hf = sum(map(len, out_ours)), sum(map(len, out_hf))
    return (
        batch,
        mode,
        n_ours / t_ours,
        n_hf / t_hf,
        (n_ours / t_ours) / (n_hf / t_hf),
        _agree(out_ours, out_hf, set(eos)),
    )


def batch_sizes(values: list[str]) -> list[int]:
    """``--batch-sizes 1,16`` or ``--batch-sizes 1 16``."""
    try:
        sizes = [int(v) for value in values for v in value.split(",") if v]
    except ValueError:
        raise EngineError(f"--batch-sizes: integers expected, got {' '.join(values)}") from None
    if not sizes or min(sizes) < 1:
        raise EngineError(f"--batch-sizes: positive integers expected, got {' '.join(values)}")
    return sizes


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: SmolLM2)")
    ap.add_argument("--batch-sizes", nargs="+", default=["1", "16"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--modes", nargs="+", default=["fixed", "eos", "serve"], choices=["fixed", "eos", "serve"]
    )
    ap.add_argument(
        "--serve-factor", type=int, default=4, help="serve mode: prompts per batch slot (default 4)"
    )
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="best of N timed runs")
    add_threads(ap, None)
    add_out(ap, "engine_vs_hf")
    ap.add_argument("--side", choices=["engine", "hf"], help=argparse.SUPPRESS)  # a child's
    ap.add_argument("--side-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.batch_sizes = batch_sizes(args.batch_sizes)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.side is not None:
        return run_side(args)
    if args.model is not None:
        return run_sides(args, argv if argv is not None else sys.argv[1:])
    pages_per_request = -(-(256 + args.max_tokens) // args.page_size)  # chat prompts < 256
    llm = LLM(
        policy="fullkv",
        page_size=args.page_size,
        kv_pages=max(args.batch_sizes) * pages_per_request,
        enable_prefix_caching=False,
    )
    hf = hf_model_from(llm)
    run_ours(llm, [[1, 2, 3]], 4, True)  # warm-up
    run_hf(hf, [[1, 2, 3]], 4, True, [2])
    rows = [
        measure(llm, hf, batch, args.max_tokens, mode, args.repeats, args.serve_factor)
        for batch in args.batch_sizes
        for mode in args.modes
    ]
    print(
        f"threads={torch.get_num_threads()}  max_tokens={args.max_tokens}  "
        f"page_size={args.page_size}  (fixed: every request max_tokens long; "
        f"eos: stop at end of turn; serve: eos with {args.serve_factor}x the prompts, "
        "continuous vs static batches)"
    )
    print(f"{'batch':>5}  {'mode':>5}  {'engine tok/s':>12}  {'HF tok/s':>9}  {'ratio':>6}  same")
    for batch, mode, ours_tps, hf_tps, ratio, same in rows:
        print(f"{batch:>5}  {mode:>5}  {ours_tps:>12.1f}  {hf_tps:>9.1f}  {ratio:>5.2f}x  {same}")
    return 0


# ---------------------------------------------------------------- --model: one child per side


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    """This process's resident memory now."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def best_run(repeats: int, run, *args) -> tuple[float, list[list[int]]]:
    """The fastest of ``repeats`` calls ``run(*args)`` returning ``(seconds, outputs)``."""
    return min((run(*args) for _ in range(repeats)), key=lambda r: r[0])


def engine_side(args: argparse.Namespace) -> dict:
    """Load ``LLM(args.model)``; time every (batch, mode) with its own chat prompts."""
    pages_per_request = -(-(256 + args.max_tokens) // args.page_size)
    start = time.perf_counter()
    llm = LLM(
        args.model,
        policy="fullkv",
        page_size=args.page_size,
        kv_pages=max(args.batch_sizes) * pages_per_request,
        enable_prefix_caching=False,
    )
    load_s, loaded_rss = time.perf_counter() - start, rss_mib()
    run_ours(llm, [[1, 2, 3]], 4, True)  # warm-up
    rows = []
    for batch in args.batch_sizes:
        for mode in args.modes:
            num = batch * args.serve_factor if mode == "serve" else batch
            prompts = [llm.tokenizer.encode_chat(QUESTIONS[i % len(QUESTIONS)]) for i in range(num)]
            engine = llm if mode != "serve" else serving_llm(llm, batch)
            fixed = mode == "fixed"
            seconds, outs = best_run(
                args.repeats, run_ours, engine, prompts, args.max_tokens, fixed
            )
            row = {"batch": batch, "mode": mode, "prompt_ids": prompts, "seconds": seconds}
            row["outputs"] = outs
            if fixed:  # prefill and first token alone
                row["first_s"] = best_run(args.repeats, run_ours, engine, prompts, 1, True)[0]
            rows.append(row)
    eos = sorted(set(llm.model.config.eos_token_ids) | set(llm.engine.eos_token_ids))
    return {"load_s": load_s, "rss_after_load_mib": loaded_rss, "eos": eos, "rows": rows}


def serving_llm(llm: LLM, batch: int) -> LLM:
    return LLM(
        llm.model,
        policy="fullkv",
        tokenizer=llm.tokenizer,
        page_size=llm.config.page_size,
        kv_pages=llm.engine.kv.num_pages,
        max_num_seqs=batch,
        enable_prefix_caching=False,
    )


def hf_side(args: argparse.Namespace, engine: dict) -> dict:
    """transformers loads the GGUF file itself and decodes the engine side's prompts."""
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        raise EngineError("transformers needs the accelerate package to load a GGUF file")
    from transformers import AutoModelForCausalLM

    path = args.model.expanduser().resolve()
    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    load_s, loaded_rss = time.perf_counter() - start, rss_mib()
    eos = engine["eos"]
    run_hf(hf, [[1, 2, 3]], 4, True, eos)  # warm-up
    rows = []
    for their in engine["rows"]:
        batch, fixed, prompts = their["batch"], their["mode"] == "fixed", their["prompt_ids"]
        seconds, outs = best_run(
            args.repeats, run_hf_batches, hf, prompts, batch, args.max_tokens, fixed, eos
        )
        row = {"batch": batch, "mode": their["mode"], "seconds": seconds, "outputs": outs}
        if fixed:
            row["first_s"] = best_run(
                args.repeats, run_hf_batches, hf, prompts, batch, 1, True, eos
            )[0]
        rows.append(row)
    return {"load_s": load_s, "rss_after_load_mib": loaded_rss, "rows": rows}


def run_side(args: argparse.Namespace) -> int:
    """A child: one side's numbers and its peak RSS into ``<--side-dir>/<side>.json``; the HF
    side reads the engine side's prompts and end tokens from ``engine.json`` there."""
    if args.side == "engine":
        result = engine_side(args)
    else:
        result = hf_side(args, json.loads((args.side_dir / "engine.json").read_text()))
    result["threads"] = torch.get_num_threads()
    result["peak_rss_mib"] = peak_rss_mib()
    (args.side_dir / f"{args.side}.json").write_text(json.dumps(result))
    return 0


def rates(row: dict) -> tuple[float, float | None]:
    """Output tokens/s, and decode tokens/s (fixed mode: after each request's first token)."""
    tokens, num = sum(map(len, row["outputs"])), len(row["outputs"])
    decode = None
    if "first_s" in row and row["seconds"] > row["first_s"]:
        decode = (tokens - num) / (row["seconds"] - row["first_s"])
    return tokens / row["seconds"], decode


def run_sides(args: argparse.Namespace, argv: list[str]) -> int:
    path = args.model.expanduser().resolve()
    if not path.is_file():
        raise EngineError(f"model file not found: {path}")
    sides = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("engine", "hf"):
            cmd = [sys.executable, __file__, *argv, "--side", side, "--side-dir", tmp]
            subprocess.run(cmd, check=True)
            sides[side] = json.loads((Path(tmp) / f"{side}.json").read_text())
    engine, hf = sides["engine"], sides["hf"]
    eos = set(engine["eos"])
    rows = []
    for ours, theirs in zip(engine["rows"], hf["rows"], strict=True):
        (ours_tps, ours_decode), (hf_tps, hf_decode) = rates(ours), rates(theirs)
        rows.append(
            {
                "batch": ours["batch"],
                "mode": ours["mode"],
                "engine_tok_s": ours_tps,
                "hf_tok_s": hf_tps,
                "ratio": ours_tps / hf_tps,
                "engine_decode_tok_s": ours_decode,
                "hf_decode_tok_s": hf_decode,
                "decode_ratio": None
                if not ours_decode or not hf_decode
                else ours_decode / hf_decode,
                "engine_tokens": sum(map(len, ours["outputs"])),
                "hf_tokens": sum(map(len, theirs["outputs"])),
                "same": _agree(ours["outputs"], theirs["outputs"], eos),
            }
        )
    print(
        f"{path.name}  threads={engine['threads']}  max_tokens={args.max_tokens}  "
        f"page_size={args.page_size}  fp32"
    )
    for name, side in (("engine", engine), ("HF", hf)):
        print(
            f"  {name:6s} load {side['load_s']:6.1f} s   RSS after load "
            f"{side['rss_after_load_mib']:6.0f} MiB   peak RSS {side['peak_rss_mib']:6.0f} MiB"
        )
    print(
        f"{'batch':>5}  {'mode':>5}  {'engine tok/s':>12}  {'HF tok/s':>9}  {'ratio':>6}  "
        f"{'engine decode':>13}  {'HF decode':>9}  {'ratio':>6}  same"
    )
    for r in rows:
        decode = (
            f"{r['engine_decode_tok_s']:>13.2f}  {r['hf_decode_tok_s']:>9.2f}  "
            f"{r['decode_ratio']:>5.2f}x"
            if r["decode_ratio"] is not None
            else f"{'-':>13}  {'-':>9}  {'-':>6}"
        )
        print(
            f"{r['batch']:>5}  {r['mode']:>5}  {r['engine_tok_s']:>12.2f}  {r['hf_tok_s']:>9.2f}  "
            f"{r['ratio']:>5.2f}x  {decode}  {r['same']}"
        )
    result = {
        "model": path.name,
        "date": time.strftime("%Y-%m-%d"),
        "commit": _commit(),
        "command": "python benchmarks/engine_vs_hf.py " + " ".join(argv),
        "threads": engine["threads"],
        "max_tokens": args.max_tokens,
        "page_size": args.page_size,
        "repeats": args.repeats,
        "dtype": "float32",
        **{
            name: {k: side[k] for k in ("load_s", "rss_after_load_mib", "peak_rss_mib")}
            for name, side in (("engine", engine), ("hf", hf))
        },
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{path.stem}.json"
    atomic_write(out, lambda tmp: Path(tmp).write_text(json.dumps(result, indent=1) + "\n"))
    print(f"wrote {out}")
    return 0


def _commit() -> str | None:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return done.stdout.strip() or None


if __name__ == "__main__":
    raise SystemExit(run_main(main))
