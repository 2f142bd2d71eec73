"""Helpers for the LLM-level engine tests: reference greedy decoding with transformers' own KV
cache, tiny-model prompts and an ``LLM`` factory."""

from __future__ import annotations

import random

import torch
from engine_helpers import random_state_dict, tiny_config, tiny_pair

from growpage.engine.llm import LLM
from growpage.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def prompt(length: int, seed: int, vocab: int = 128) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from transformers, decoding with its own KV cache (no EOS stop)."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(n - 1):
        out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@torch.inference_mode()
def hf_nll(model, ids: list[int], continuation: list[int]) -> list[float]:
    """Teacher-forced NLL of each continuation token under transformers (full KV)."""
    seq = torch.tensor([ids + continuation])
    logp = torch.log_softmax(model(seq).logits[0].float(), dim=-1)
    rows = torch.arange(len(ids) - 1, len(ids) + len(continuation) - 1)
    return (-logp[rows, torch.tensor(continuation)]).tolist()


def tiny_llm(model, policy: str = "fullkv", **kwargs) -> LLM:
    """An ``LLM`` over the tiny model: 4-token pages, recent window 2, 256 pages by default."""
    kwargs.setdefault("page_size", 4)
    kwargs.setdefault("recent_window", 2)
    kwargs.setdefault("kv_pages", 256)
    return LLM(model, policy=policy, **kwargs)


def assert_all_returned(llm: LLM) -> None:
    """Every page back in the pool, every query slot free, bookkeeping consistent."""
    kv = llm.engine.kv
    kv.pool.check_invariants()
    assert kv.pool.num_free_pages == kv.num_pages
    assert kv.query_pool.num_free_slots == kv.query_pool.max_slots
    assert not llm.engine.has_unfinished()


def tiny_models(seed: int = 1234):
    """``(ours, transformers)`` tiny Llama pair with identical random weights."""
    return tiny_pair("llama", seed=seed)


def tiny_model(seed: int = 1234):
    """Only our tiny Llama (same weights as ``tiny_models(seed)[0]``), without transformers."""
    from growpage.engine.loader import build_model

    cfg = tiny_config("llama")
    return build_model(cfg, random_state_dict(cfg, seed=seed))


def hf_from_ours(model):
    """A transformers Llama (sdpa attention) with the weights of our loaded ``CausalLM``."""
    from engine_helpers import hf_config
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(hf_config(model.config), dtype=torch.float32)
    missing, unexpected = ref.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    ref.tie_weights()
    return ref.eval()


def watch_steps(llm: LLM) -> list[tuple[set[str], set[str]]]:
    """Per decode step: (the requests it decodes, the requests that sit it out with work
    deferred beside it: a compression, or with ``async_decisions`` a whole boundary)."""
    engine, steps = llm.engine, []
    schedule = engine.scheduler.schedule

    def watched():
        out = schedule()
        if not out.is_prefill:
            deferred = {seq.request_id for seq in engine.scheduler.running
                        if engine.kv.is_deferred(seq)}
            steps.append(({seq.request_id for seq in out.seqs}, deferred))
        return out

    engine.scheduler.schedule = watched
    return steps
