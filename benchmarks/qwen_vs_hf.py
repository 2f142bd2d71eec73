"""Does our engine read a real Qwen2 GGUF file as transformers does, token for token (fp32)?

Tokenizer, chat template, end tokens and greedy tokens.

    python benchmarks/qwen_vs_hf.py --model ~/.cache/growpage/models/qwen2.5-coder-0.5b.gguf
        [--prompts 8] [--max-tokens 32] [--threads N] [--out results/qwen_vs_hf]

transformers reads the same file itself (``AutoTokenizer`` / ``AutoModelForCausalLM``
``.from_pretrained(dir, gguf_file=name)``: its own reader, dequantization and name mapping; the
model needs the ``accelerate`` package). Checks, in order:

1. tokenizer: ids of a corpus (the prompts, their chat renderings, code, numbers, unicode,
   whitespace runs, special and user-defined tokens, this script and two engine modules) equal
   transformers' ids, and decoding gives the same text;
2. chat template: our rendering of a few conversations equals ``apply_chat_template``'s;
3. end tokens: the engine stops on ``<|im_end|>`` and ``<|endoftext|>``;
4. greedy tokens: ``--prompts`` chat-formatted maths word problems, ``--max-tokens`` new tokens
   each, one prompt at a time on both sides (ours: ``LLM`` under ``fullkv``; transformers:
   ``generate``, stopping at the same end tokens). At the first divergence both models' logits
   of the two tokens at stake are printed and kept.

Prints one line per check and per prompt; writes ``<out>/<model file stem>.json``. Exit status
1 when any check fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from script_args import ROOT, add_out, add_threads, parser, run_main

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from growpage.core.traces import atomic_write  # noqa: E402
from growpage.engine.llm import LLM  # noqa: E402
from growpage.engine.modeling.step_context import prefill_context, use_context  # noqa: E402
from growpage.engine.sampling_params import SamplingParams  # noqa: E402
from growpage.errors import EngineError  # noqa: E402

END_TOKENS = ("<|im_end|>", "<|endoftext|>")
PROBLEMS = [
    "A baker makes 14 loaves a day. How many loaves does she make in 3 weeks?",
    "Tom has 52 marbles and gives a quarter of them to his sister. How many are left?",
    "A train travels 180 km in 2.5 hours. What is its average speed in km/h?",
    "A shirt costs $40 and is on sale for 15% off. What is the sale price?",
    "If 6 pencils cost $2.10, how much do 10 pencils cost?",
    "A rectangle is 12 m long and 7 m wide. What is its perimeter and its area?",
    "Sara reads 23 pages a day. How many days does she need for a 300-page book?",
    "Three friends split a $96 bill, and one pays $8 more than each of the others. "
    "What does each pay?",
    "A tank holds 250 litres and leaks 4 litres an hour. How much is left after a day?",
    "What is the sum of the first 20 odd numbers?",
]
CORPUS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i * 1234567); }',
    "  leading spaces,\ttabs\t\tand   runs   \n\n\n of newlines\r\n",
    "Numbers: 3.14159, 1,000,000, 2026-12-04, 0x1F, 1e-9, 12345678901234567890",
    "Unicode: café naïve coöperate Ελληνικά русский 中文测试 日本語 한국어 🙂👍🏽 e\u0301",
    "They'll say it's what we'd've done; THEY'RE sure I'M right.",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
    '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "",
]


def chat(problem: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{problem} Answer step by step."}]


def conversations() -> list[list[dict[str, str]]]:
    return [
        chat(PROBLEMS[0]),
        [{"role": "system", "content": "You are a careful tutor."}, *chat(PROBLEMS[1])],
        [
            *chat(PROBLEMS[2]),
            {"role": "assistant", "content": "It is 72 km/h."},
            {"role": "user", "content": "And in m/s?"},
        ],
    ]


def check_tokenizer(ours, theirs, texts: list[str]) -> dict:
    bad = []
    for text in texts:
        ids, want = ours.encode(text), theirs.encode(text)
        if ids != want or ours.decode(ids, skip_special_tokens=False) != theirs.decode(want):
            bad.append({"text": text, "ours": ids, "transformers": want})
    return {"texts": len(texts), "tokens": sum(len(ours.encode(t)) for t in texts), "bad": bad}


def check_template(ours, theirs) -> dict:
    bad = []
    num = 0
    for messages in conversations():
        for gen in (True, False):
            num += 1
            want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            got = ours.apply_chat_template(messages, add_generation_prompt=gen)
            if got != want:
                bad.append({"messages": messages, "ours": got, "transformers": want})
    return {"renderings": num, "bad": bad}


def hf_model(path: Path):
    if importlib.util.find_spec("accelerate") is None:
        raise EngineError(
            "transformers needs the accelerate package to load a GGUF file: "
            "`pip install accelerate` (or put it on PYTHONPATH)"
        )
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


@torch.inference_mode()
def hf_generate(model, ids: list[int], max_tokens: int, eos: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos[-1],
    )
    return out[0, len(ids) :].tolist()


@torch.inference_mode()
def last_logits(llm: LLM, hf, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logits ``[V]`` after ``ids``: ours (dense prefill), transformers'."""
    model = llm.model
    model.bind_kv_cache(None)
    with use_context(prefill_context([len(ids)])):
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)))[-1:])[0]
    return ours, hf(torch.tensor([ids])).logits[0, -1].float()


def divergence(llm: LLM, hf, ids: list[int], a: list[int], b: list[int]) -> dict | None:
    """Where greedy tokens ``a`` (ours) and ``b`` (transformers') part, with both models'
    logits of the two tokens there."""
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if i is None:
        return (
            None
            if len(a) == len(b)
            else {"index": min(len(a), len(b)), "lengths": [len(a), len(b)]}
        )
    ours, theirs = last_logits(llm, hf, ids + a[:i])
    return {
        "index": i,
        "ours_token": a[i],
        "transformers_token": b[i],
        "ours_logits": [float(ours[a[i]]), float(ours[b[i]])],
        "transformers_logits": [float(theirs[a[i]]), float(theirs[b[i]])],
        "max_abs_logit_diff": float((ours - theirs).abs().max()),
    }


def commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", type=Path, required=True, help="a Qwen2 GGUF file")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    add_threads(ap, None)
    add_out(ap, "qwen_vs_hf")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not 1 <= args.prompts <= len(PROBLEMS):
        raise EngineError(f"--prompts must be in 1..{len(PROBLEMS)}, got {args.prompts}")
    path = args.model.expanduser().resolve()
    if not path.is_file():
        raise EngineError(f"model file not found: {path}")
    from transformers import AutoTokenizer

    start = time.perf_counter()
    llm = LLM(path, policy="fullkv", page_size=64, kv_pages=16, enable_prefix_caching=False)
    load_ours = time.perf_counter() - start
    tok = llm.tokenizer
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    prompts = [tok.encode_chat(chat(p)) for p in PROBLEMS[: args.prompts]]
    sources = [ROOT / "growpage" / "engine" / n for n in ("dequant.py", "tokenizer.py")]
    texts = (
        CORPUS
        + PROBLEMS
        + [tok.apply_chat_template(m) for m in conversations()]
        + [f.read_text() for f in (Path(__file__), *sources)]  # code, a few thousand tokens
    )
    report: dict = {
        "model": path.name,
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "command": "python benchmarks/qwen_vs_hf.py " + " ".join(argv or sys.argv[1:]),
        "threads": torch.get_num_threads(),
        "dtype": "float32",
        "tokenizer": check_tokenizer(tok, theirs, texts),
        "chat_template": check_template(tok, theirs),
    }
    end_ids = [tok.token_to_id(t) for t in END_TOKENS]
    report["end_tokens"] = {
        "ids": end_ids,
        "engine_stops_on": sorted(llm.engine.eos_token_ids),
        "ok": None not in end_ids and set(end_ids) <= llm.engine.eos_token_ids,
    }
    t = report["tokenizer"]
    print(f"{path.name}: ours loaded in {load_ours:.1f} s; threads {torch.get_num_threads()}")
    print(f"tokenizer: {t['texts'] - len(t['bad'])}/{t['texts']} texts ({t['tokens']} tokens) same")
    c = report["chat_template"]
    print(f"chat template: {c['renderings'] - len(c['bad'])}/{c['renderings']} renderings same")
    print(
        f"end tokens {END_TOKENS} = {end_ids}: engine stops on them: {report['end_tokens']['ok']}"
    )

    start = time.perf_counter()
    hf = hf_model(path)
    report["load_s"] = {"ours": load_ours, "transformers": time.perf_counter() - start}
    params = SamplingParams(max_tokens=args.max_tokens)
    rows = []
    for problem, ids in zip(PROBLEMS[: len(prompts)], prompts, strict=True):
        ours = llm.generate([ids], params, use_tqdm=False)[0].token_ids
        want = hf_generate(hf, ids, args.max_tokens, end_ids)
        diff = divergence(llm, hf, ids, ours, want)
        rows.append(
            {
                "problem": problem,
                "prompt_tokens": len(ids),
                "ours": ours,
                "transformers": want,
                "match": diff is None,
                "divergence": diff,
                "text": tok.decode(ours),
            }
        )
        line = "tokens match" if diff is None else f"DIVERGE {json.dumps(diff)}"
        print(f"  prompt {len(rows)} ({len(ids)} tokens, {len(ours)} new): {line}")
    report["greedy"] = rows
    ok = (
        not t["bad"]
        and not c["bad"]
        and report["end_tokens"]["ok"]
        and all(r["match"] for r in rows)
    )
    report["ok"] = ok
    print(f"greedy: {sum(r['match'] for r in rows)}/{len(rows)} prompts token-identical")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{path.stem}.json"
    atomic_write(out, lambda tmp: Path(tmp).write_text(json.dumps(report, indent=1) + "\n"))
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(run_main(main))
