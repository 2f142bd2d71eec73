"""bfloat16 weights and KV, the engine's default on CUDA (skipped without a CUDA device).

The oracle is SmolLM2 in float32 on the CPU, which matches transformers token for token
(``test_engine_smollm2.py``). bf16 keeps 8 bits of mantissa, so where float32's two best tokens
are nearly tied bf16 may pick the other one; everywhere float32's best token leads by more than
half a logit, bf16's greedy token must be float32's. The check runs teacher-forced on bf16's own
tokens, so a near-tie early does not end the comparison.
"""

from __future__ import annotations

import pytest
import torch

from growpage.engine.config import EngineConfig
from growpage.engine.llm import LLM
from growpage.engine.loading.loader import load_model
from growpage.engine.modeling.step_context import prefill_context, use_context
from growpage.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Write a short story about a robot who learns to paint.",
    "Explain step by step how to compute 17 * 23.",
]
CLEAR = 0.5  # logits: float32's lead above which bf16 may not change the greedy token


@pytest.fixture(scope="module")
def fp32_cpu():
    return load_model()  # float32 on the CPU


@pytest.fixture(scope="module")
def bf16_cuda():
    return LLM(policy="fullkv", page_size=16, kv_pages=64, device="cuda")


def test_the_default_dtype_on_cuda_is_bfloat16(bf16_cuda):
    assert EngineConfig().dtype == torch.float32  # the CPU keeps float32
    assert EngineConfig(device="cuda", dtype="auto").dtype == torch.bfloat16
    assert EngineConfig(device="cuda", dtype="float32").dtype == torch.float32
    assert bf16_cuda.config.dtype == torch.bfloat16
    assert {p.dtype for p in bf16_cuda.model.parameters()} == {torch.bfloat16}
    assert bf16_cuda.engine.kv.cache.dtype == torch.bfloat16
    assert bf16_cuda.engine.kv.cache.is_cuda


@torch.inference_mode()
def test_bf16_greedy_tokens_are_fp32s_wherever_fp32_is_clear(bf16_cuda, fp32_cpu):
    params = SamplingParams(max_tokens=64, ignore_eos=True)  # 64 tokens each to compare
    outs = bf16_cuda.generate(CHATS, params, use_tqdm=False)
    model = fp32_cpu
    compared = clear_total = 0
    for chat, out in zip(CHATS, outs, strict=True):
        ids = list(out.prompt_token_ids) + list(out.token_ids)
        with use_context(prefill_context([len(ids)])):
            logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))
        start = len(out.prompt_token_ids) - 1  # row predicting the first generated token
        rows = logits[start : start + len(out.token_ids)]
        top2 = rows.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > CLEAR
        got = torch.tensor(out.token_ids)
        mismatch = clear & (rows.argmax(-1) != got)
        assert not bool(mismatch.any()), (
            f"bf16 left fp32's clear choice at generated positions "
            f"{mismatch.nonzero().flatten().tolist()} of {chat!r}"
        )
        compared += len(out.token_ids)
        clear_total += int(clear.sum())
    assert compared == 64 * len(CHATS) and clear_total >= compared // 2, (compared, clear_total)
