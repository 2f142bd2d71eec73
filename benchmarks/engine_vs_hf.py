"""Engine (fullkv) vs Hugging Face ``generate``: output tokens/s at batch 1 and 16 on CPU.

Same model weights (SmolLM2-135M-Instruct, fp32; the HF model is built from our loaded state
dict), same chat prompts, greedy. Two modes: ``fixed`` makes every request exactly
``--max-tokens`` long (EOS ignored on our side, ``min_new_tokens`` on HF's); ``eos`` stops each
request at its end-of-turn token (capped at ``--max-tokens``): the engine retires finished
requests at once, HF's batch decodes until its longest row ends. ``serve`` is ``eos`` with
``--serve-factor`` (4) times as many prompts as the batch size: the engine keeps ``batch``
requests running and admits the next one as soon as one ends (continuous batching, as a server
does), HF runs the prompts in consecutive static batches of ``batch``. Output tokens/s counts
only real output tokens. Prints a table; not a test.

    python benchmarks/engine_vs_hf.py [--threads 1] [--batch-sizes 1 16] [--max-tokens 64]

On a shared CPU use one thread: with two, a core taken by another process stalls every GEMM.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from growpage.engine.llm import LLM  # noqa: E402
from growpage.engine.sampling_params import SamplingParams  # noqa: E402

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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--modes", nargs="+", default=["fixed", "eos", "serve"], choices=["fixed", "eos", "serve"]
    )
    ap.add_argument(
        "--serve-factor", type=int, default=4, help="serve mode: prompts per batch slot (default 4)"
    )
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="best of N timed runs")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
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


if __name__ == "__main__":
    from script_main import run_main

    raise SystemExit(run_main(main))
