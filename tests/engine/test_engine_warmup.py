"""``LLM(warmup=True)``: every Triton kernel variant a serving run launches is launched once
when the engine is built (``growpage.engine.loop.warmup``), and the engine's state is untouched.

Runs the kernels under Triton's CPU interpreter (on a GPU, on the GPU); the compile keys come
from ``growpage.kernels.variants``, which applies Triton's own specialization rules.
"""

from __future__ import annotations

import random

import pytest
import torch
from llm_helpers import assert_all_returned, tiny_model

import growpage.kernels  # noqa: F401  (turns the interpreter on without CUDA)
import growpage.kernels.decode_attention as decode_module
from growpage.engine.llm import LLM
from growpage.engine.sampling_params import SamplingParams
from growpage.kernels.variants import compiled_variants, record_variants

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


pytestmark = pytest.mark.usefixtures("one_thread")


def kernel_llm(policy: str = "growpage", warmup: bool = True, **kwargs) -> LLM:
    kwargs.setdefault("kv_pages", 26)
    kwargs.setdefault("cuda_graphs", False)  # the eager path (graphs capture as they meet shapes)
    return LLM(
        tiny_model(),
        policy=policy,
        page_size=8,
        recent_window=2,
        max_num_seqs=4,
        device=DEVICE,
        dtype=torch.float32,  # as the tiny model (CUDA's default would be bf16)
        attention_backend="triton",
        boundary_kernels=True,
        warmup=warmup,
        **kwargs,
    )


def workload(seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randrange(5, 30))] for _ in range(4)]
    # Enough tokens for both boundary outcomes; the tests assert that they occur.
    params = [SamplingParams(max_tokens=rng.randrange(8, 18), ignore_eos=True) for _ in prompts]
    return prompts, params


def test_warm_up_launches_every_variant_a_run_needs(monkeypatch):
    # Split counts of a big GPU, varying with batch and context (the CPU default is always 1):
    # the run must still need no decode-attention variant beyond the warm-up's two.
    monkeypatch.setattr(
        decode_module,
        "default_num_splits",
        lambda num_seqs, hkv, max_context, device, block_n: 1 + (num_seqs + max_context // 8) % 4,
    )
    with record_variants() as at_start:
        llm = kernel_llm()
    report = llm.engine.warmup_report
    assert report.ran and report.variants == at_start.counts()
    assert at_start.counts() == {
        "boundary_queries": 1,
        "compact": 3,
        "decode_attention": 2,
        "demand_logits": 1,
        "demand_normalize": 1,
        "merge_splits": 1,
        "store_kv": 1,
    }
    prompts, params = workload()
    compiled = compiled_variants()  # on CUDA: the binaries themselves ({} elsewhere)
    with record_variants() as serving:
        llm.generate(prompts, params, use_tqdm=False)
    events = llm.last_stats.events
    assert events["compress"] > 0 and events["grow"] > 0, events  # both boundary paths ran
    assert serving.new_since(at_start) == {}, serving.new_since(at_start)
    # The run met every kernel of the warm-up, and both decode-attention variants.
    assert set(serving.counts()) == set(at_start.counts()), serving.counts()
    assert serving.counts()["decode_attention"] == 2, serving.counts()
    assert compiled_variants() == compiled  # nothing compiled while serving
    assert_all_returned(llm)


def test_warm_up_changes_nothing_the_engine_serves_with():
    prompts, params = workload(1)
    cold = kernel_llm(warmup=False)
    assert not cold.engine.warmup_report.ran
    warm = kernel_llm()
    engine, kv = warm.engine, warm.engine.kv
    assert kv.pool.num_free_pages == kv.num_pages and kv.query_pool.num_free_slots == 4
    assert engine.stats.num_steps == 0 and not any(engine.kv.controller.events.as_dict().values())
    layer0 = engine.model.model.layers[0].self_attn.kv_cache
    assert layer0.data_ptr() == kv.cache[:, 0].data_ptr()  # the model is bound back
    assert engine.model.backend.num_splits is None  # the split override is undone
    outs_cold = cold.generate(prompts, params, use_tqdm=False)
    outs_warm = warm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs_warm] == [o.token_ids for o in outs_cold]
    assert warm.last_stats.events == cold.last_stats.events
    events = warm.last_stats.events
    assert events["compress"] > 0 and events["grow"] > 0, events  # both boundary paths ran


def test_no_warm_up_without_kernels():
    llm = LLM(
        tiny_model(),
        policy="growpage",
        page_size=8,
        recent_window=2,
        kv_pages=16,
        attention_backend="torch",
        boundary_kernels=False,
        warmup=True,
    )
    assert not llm.engine.warmup_report.ran and llm.engine.warmup_report.launches == 0
