"""What recording H2O accumulated attention costs the engine's forward passes.

Two engines over one model run the same requests with the same decisions: ``growpage``, and
the same policy asking for the sums (``needs_accumulated_attention``), which the engine then
adds in every step. Only the runner's forward passes are timed (``ModelRunner.run``), decode
and prefill apart; the two engines alternate, ``--repeats`` times each::

    python benchmarks/h2o_overhead.py                        # tiny random model, torch backend
    python benchmarks/h2o_overhead.py --model smollm2 --threads 2
    python benchmarks/h2o_overhead.py --backend triton       # on a GPU (the kernel)

Reports the median over repeats of ms per decode step and per prefill step, and the ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # boundary_ops, when loaded by path

from boundary_ops import tiny_model  # noqa: E402  (imports growpage.kernels first)

from growpage.engine.llm import LLM  # noqa: E402
from growpage.engine.sampling_params import SamplingParams  # noqa: E402
from growpage.kernels import without_index_checks  # noqa: E402
from growpage.policies.builtin import GrowPagePolicy  # noqa: E402


@attrs.define
class RecordingGrowPage(GrowPagePolicy):
    """GrowPage's decisions; the engine records the H2O sums (never read)."""

    needs_accumulated_attention = True


def timed(llm: LLM) -> dict[str, list[float]]:
    """Wrap the runner: wall seconds of each forward pass, by kind."""
    runner, times = llm.engine.runner, {"decode": [], "prefill": []}
    run = runner.run

    def wrapper(out):
        start = time.perf_counter()
        result = run(out)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        times["prefill" if out.is_prefill else "decode"].append(time.perf_counter() - start)
        return result

    runner.run = wrapper
    return times


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (random), smollm2, or a GGUF path")
    p.add_argument("--backend", default="torch")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-pages", type=int, default=None, help="default: 512 MiB of cache")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = (
        tiny_model() if args.model == "tiny" else (None if args.model == "smollm2" else args.model)
    )
    kwargs = dict(
        page_size=args.page_size,
        kv_pages=args.kv_pages,
        max_num_seqs=args.requests,
        device=args.device,
        attention_backend=args.backend,
        enable_prefix_caching=False,
        warmup=True,
    )
    plain = LLM(model, policy=GrowPagePolicy(), **kwargs)
    recording = LLM(plain.model, policy=RecordingGrowPage(), tokenizer=plain.tokenizer, **kwargs)
    vocab = plain.model.config.vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows: dict[str, dict[str, list[float]]] = {
        "plain": {"decode": [], "prefill": []},
        "recording": {"decode": [], "prefill": []},
    }
    for _ in range(args.repeats):
        tokens = []
        for name, llm in (("plain", plain), ("recording", recording)):
            times = timed(llm)
            # The kernels' index checks (on under the interpreter, off on a GPU unless asked
            # for) would add the same host work to both arms and shrink the ratio.
            with without_index_checks():
                outs = llm.generate(prompts, params, use_tqdm=False)
            tokens.append([o.token_ids for o in outs])
            del llm.engine.runner.run
            for kind in times:
                rows[name][kind].append(1e3 * sum(times[kind]) / max(len(times[kind]), 1))
        assert tokens[0] == tokens[1], "recording the sums changed the output"
    report = {
        name: {kind: statistics.median(v) for kind, v in kinds.items()}
        for name, kinds in rows.items()
    }
    print(
        f"model {args.model}, backend {args.backend}, {args.requests} requests x "
        f"{args.prompt_len} + {args.max_tokens} tokens, torch threads "
        f"{torch.get_num_threads()}; median of {args.repeats} runs, ms per step:"
    )
    for kind in ("decode", "prefill"):
        a, b = report["plain"][kind], report["recording"][kind]
        print(f"  {kind:8s} plain {a:8.2f}   recording {b:8.2f}   ({100 * (b / a - 1):+.1f}%)")
    return report


if __name__ == "__main__":
    from script_main import run_main

    sys.exit(run_main(main))
