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
    """An ``LLM`` over the tiny model: 4-token pages, recent window 2, 256 pages, float32 by
    default (also on CUDA, whose own default is bfloat16: the tests compare against float32
    references on the CPU)."""
    kwargs.setdefault("dtype", torch.float32)
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
    from growpage.engine.loading.loader import build_model

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
            deferred = {
                seq.request_id
                for seq in engine.scheduler.running
                if engine.kv.deferred.is_deferred(seq)
            }
            steps.append(({seq.request_id for seq in out.seqs}, deferred))
        return out

    engine.scheduler.schedule = watched
    return steps


def served_both_ways(model, policy, prompts, params, flag: str, **kwargs):
    """``prompts`` served by the synchronous engine and by one with ``flag`` on (an
    ``LLM`` keyword such as ``async_compaction``): ``(sync, its outputs, llm, its outputs)``."""
    sync = tiny_llm(model, policy, **kwargs)
    want = sync.generate(prompts, params, use_tqdm=False)
    llm = tiny_llm(model, policy, **{flag: True}, **kwargs)
    got = llm.generate(prompts, params, use_tqdm=False)
    return sync, want, llm, got


def assert_sat_out_one_step(steps: list[tuple[set[str], set[str]]]) -> int:
    """``watch_steps``' log: each request that sat a step out was absent from it while others
    decoded, and back the next step. Returns how many sit-outs there were (at least one)."""
    sat_out = [(i, deferred) for i, (_, deferred) in enumerate(steps) if deferred]
    assert sat_out, "no request sat a step out"
    for i, deferred in sat_out:
        decoded = steps[i][0]
        assert decoded and not decoded & deferred  # the others decode without them
        assert deferred <= steps[i + 1][0]  # and they are back one step later
    return sum(len(d) for _, d in sat_out)


def engine_and_simulator_steps(model, policy: str, kwargs: dict, flag: str):
    """Three requests in the engine (tiny model) and in the serving simulator (same page size,
    1 s per step), without and with ``flag`` (``async_compaction`` / ``async_decisions``, a
    keyword of both ``LLM`` and ``SimConfig``): ``{flag value: (engine stats, sim metrics)}``."""
    from growpage import GrowPageConfig
    from growpage.policies import resolve_policy
    from growpage.sim.costmodel import LinearCostModel
    from growpage.sim.serving import SimConfig, simulate
    from growpage.sim.workload_csv import WorkloadRequest

    lengths = [(5, 40), (11, 90), (7, 65)]
    prompts = [prompt(p, 30 + i) for i, (p, _) in enumerate(lengths)]
    params = [SamplingParams(max_tokens=o, ignore_eos=True) for _, o in lengths]
    requests = [WorkloadRequest(f"r{i}", 0.0, p, o) for i, (p, o) in enumerate(lengths)]
    runs = {}
    for on in (False, True):
        llm = tiny_llm(model, policy=policy, policy_kwargs=kwargs, **{flag: on})
        llm.generate(prompts, params, use_tqdm=False)
        served = simulate(
            requests,
            resolve_policy(policy, **kwargs),
            GrowPageConfig(page_size=4, recent_window=2),
            SimConfig(num_kv_pages=256, **{flag: on}),
            LinearCostModel(base_s=1.0),
        )
        runs[on] = (llm.last_stats, served.metrics)
    return runs


def fail_the_first_step_with_deferred_work(
    llm: LLM, prompts, params, added: list | None = None
) -> dict:
    """Add ``prompts`` (their sequences appended to ``added``), then step until a step has
    deferred work (compressions or late boundaries) and make its forward fail. Returns what the
    requests sitting that step out held then, ``{request id: (num_tokens, block table)}``; the
    runner is restored."""
    engine, run = llm.engine, llm.engine.runner.run
    seen: dict = {}

    def failing(out):
        if engine.kv.deferred.num_pending and not seen:
            seen.update(
                {
                    s.request_id: (s.state.num_tokens, list(s.state.block_table))
                    for s in engine.scheduler.running
                    if engine.kv.deferred.is_deferred(s)
                }
            )
            raise RuntimeError("device lost")
        return run(out)

    for i, ids in enumerate(prompts):
        seq = engine.add_request(str(i), ids, params)
        if added is not None:
            added.append(seq)
    engine.runner.run = failing
    try:
        for _ in range(500):
            try:
                engine.step()
            except RuntimeError as exc:
                assert "device lost" in str(exc) and seen, exc
                return seen
        raise AssertionError("no step deferred any work")
    finally:
        engine.runner.run = run


def assert_left_at_their_boundaries(llm: LLM, seen: dict) -> None:
    """After a failed step: nothing pending, and the requests that sat it out unchanged, still
    at their boundaries."""
    engine = llm.engine
    assert engine.kv.deferred.num_pending == 0
    for seq in engine.scheduler.running:
        if seq.request_id in seen:
            assert (seq.state.num_tokens, seq.state.block_table) == seen[seq.request_id]
            assert engine.kv.controller.needs_decision(seq.state)


# The workload both deferred-work test modules serve (async compaction, late boundaries): four
# requests of different prompt lengths, 80 output tokens each.
DEFERRED_PROMPTS = [prompt(9, 21), prompt(17, 22), prompt(6, 23), prompt(13, 24)]
DEFERRED_LONG = SamplingParams(max_tokens=80, ignore_eos=True)
