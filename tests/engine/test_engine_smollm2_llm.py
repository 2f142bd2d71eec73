"""``LLM`` with the real SmolLM2-135M-Instruct (loaded once per session): greedy output
identical to transformers, a sensible chat answer, GrowPage on real attention, the CLI."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from llm_helpers import assert_all_returned, hf_from_ours, hf_greedy

from growpage import cli
from growpage.core.trace_set import TraceSet
from growpage.engine import cli as engine_cli
from growpage.engine.llm import LLM
from growpage.engine.modeling.step_context import prefill_context, use_context
from growpage.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

CHATS = [
    "Write a haiku about the sea.",
    "Write a short story about a robot who learns to paint.",
    "Explain photosynthesis in one sentence.",
]


@pytest.fixture(scope="session")
def smol() -> Iterator[LLM]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a loaded 2-core machine: one thread is fastest and steadiest
    yield LLM(policy="fullkv", page_size=16, kv_pages=512)
    torch.set_num_threads(threads)


def sibling(smol: LLM, **kwargs) -> LLM:
    """Another engine over the same loaded model and tokenizer."""
    kwargs.setdefault("page_size", 16)
    kwargs.setdefault("kv_pages", 512)
    return LLM(smol.model, tokenizer=smol.tokenizer, **kwargs)


def test_fullkv_greedy_batch_identical_to_transformers(smol):
    prompts = [smol.tokenizer.encode_chat(c) for c in CHATS]
    outs = smol.generate(prompts, SamplingParams(max_tokens=36, ignore_eos=True), use_tqdm=False)
    ref = hf_from_ours(smol.model)
    for p, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(ref, p, 36)
    assert_all_returned(smol)


def test_chat_answer_is_sensible(smol):
    out = smol.generate("What is 2+2?", SamplingParams(max_tokens=48), chat=True, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and "4" in out.text
    assert out.token_ids[-1] == smol.tokenizer.eos_token_id
    stop = smol.generate(
        "What is 2+2?", SamplingParams(max_tokens=48, stop=["4"]), chat=True, use_tqdm=False
    )[0]
    assert stop.finish_reason == "stop" and "4" not in stop.text and out.text.startswith(stop.text)


STORY = (
    "Once upon a time, in a small workshop at the edge of a busy city, there lived a "
    "robot named Pixel. Pixel had been built to sort screws and bolts, but every evening, "
    "when the workshop grew quiet, it watched the sunset through a dusty window. The colors "
    "changed every day: orange, then pink, then a deep violet that made its sensors hum. "
    "One night Pixel found an old box of paints under a workbench. It dipped a thin metal "
    "finger into the blue and drew a wobbly line on a scrap of cardboard. The line was "
    "crooked, but Pixel felt something new, a warm flicker in its circuits. It painted "
    "every night after that, and slowly its lines became waves, its waves became oceans, "
    "and its oceans filled the walls of the workshop with light."
)


@torch.inference_mode()
def dense_nll(model, ids: list[int], continuation: list[int]) -> float:
    """Mean teacher-forced NLL with full attention, from one dense forward pass."""
    seq = ids + continuation
    with use_context(prefill_context([len(seq)])):
        logits = model.compute_logits(model(torch.tensor(seq), torch.arange(len(seq))))
    logp = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)
    return float(-logp[torch.arange(len(continuation)), torch.tensor(continuation)].mean())


def test_growpage_on_real_attention_compresses_and_scores_close_to_fullkv(smol):
    prompt = smol.tokenizer.encode_chat(CHATS[1])
    story = smol.tokenizer.encode(STORY, add_special_tokens=False)
    full = dense_nll(smol.model, prompt, story)
    llm = sibling(smol, policy="growpage")
    out = llm.score([prompt], [story])[0]
    assert len(out.token_nlls) == len(story) > 140
    assert out.events["compress"] > 0 and out.events["decided_grow"] > 0
    assert llm.last_stats.avg_kv_budget < (len(prompt) + len(story)) * 0.9
    assert full < out.mean_nll < full + 0.5  # close to full attention, not better by chance
    assert_all_returned(llm)


def test_cli_generate_and_record(smol, tmp_path, monkeypatch, capsys):
    built = []

    def build(model, **kw):
        built.append(sibling(smol, **{k: v for k, v in kw.items() if v is not None}))
        return built[-1]

    monkeypatch.setattr(engine_cli, "_build_llm", build)
    assert (
        cli.main(
            ["generate", "--prompt", "What is 2+2?", "--max-tokens", "40", "--page-size", "16"]
        )
        == 0
    )
    text = text_of_first = capsys.readouterr().out
    assert "4" in text.splitlines()[0]
    for row in (
        "throughput (TPS)",
        "TPOT",
        "avg resident requests C",
        "avg KV budget",
        "grow / compress / shrink",
        "fallbacks",
        "preemptions",
    ):
        assert row in text
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Name a color.\n\nCount to three.\n")
    assert (
        cli.main(
            [
                "record",
                "--prompts",
                str(prompts),
                "--out",
                str(tmp_path / "set"),
                "--max-tokens",
                "8",
                "--layers",
                "0,29",
                "--no-progress",
            ]
        )
        == 0
    )
    traces = TraceSet(tmp_path / "set")
    assert len(traces) == 2 and traces.read(0).header.layer_ids == (0, 29)
    assert "already there" not in capsys.readouterr().out
    # Recording into the same set again adds to it, and says so.
    assert (
        cli.main(
            [
                "record",
                "--prompts",
                str(prompts),
                "--out",
                str(tmp_path / "set"),
                "--max-tokens",
                "2",
                "--layers",
                "0",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "added to the 2 traces already there: the set now holds 4" in capsys.readouterr().out
    assert len(TraceSet(tmp_path / "set")) == 4
    assert cli.main(["generate", "--prompt", "hi", "--policy", "nope"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    # Several prompts, as one batch: each answer under its own header, then the statistics.
    assert (
        cli.main(
            [
                "generate",
                "--prompt",
                "Name a color.",
                "--prompt",
                "Count to three.",
                "--max-tokens",
                "8",
                "--no-progress",
                "--async-compaction",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "### 1/2: Name a color." in text and "### 2/2: Count to three." in text
    assert text.count("finish reason") == 2 and "throughput (TPS)" in text
    assert built[-1].config.async_compaction and built[-1].last_stats.num_requests == 2
    assert (
        cli.main(["generate", "--prompts", str(prompts), "--max-tokens", "4", "--no-progress"]) == 0
    )
    assert "### 2/2: Count to three." in capsys.readouterr().out
    assert not built[-1].config.async_compaction
    if not torch.cuda.is_available():  # --device auto is the CPU: graphs are refused
        assert cli.main(["generate", "--prompt", "hi", "--cuda-graphs"]) == 2
        assert "cuda_graphs needs a CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one source of prompts
        cli.main(["generate", "--prompt", "hi", "--prompts", str(prompts)])
    # --stream prints the answer as it comes: the same text generate prints.
    assert (
        cli.main(
            [
                "generate",
                "--prompt",
                "What is 2+2?",
                "--max-tokens",
                "40",
                "--page-size",
                "16",
                "--stream",
            ]
        )
        == 0
    )
    streamed = capsys.readouterr().out
    assert streamed.split("\nfinish reason")[0] == text_of_first.split("\nfinish reason")[0]
    assert "throughput (TPS)" in streamed and built[-1].last_stats.num_requests == 1
    assert cli.main(["generate", "--prompt", "a", "--prompt", "b", "--stream"]) == 2
    assert (
        "--stream prints one answer as it comes: give a single prompt (got 2)"
        in capsys.readouterr().err
    )
