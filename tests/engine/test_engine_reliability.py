"""Memory pressure and bad input: every request finishes, every page comes back, errors are
clear and leave the engine usable."""

from __future__ import annotations

import sys

import attrs
import numpy as np
import pytest
import torch
from engine_helpers import random_state_dict, tiny_config
from llm_helpers import GREEDY, assert_all_returned, prompt, tiny_llm, tiny_models

from growpage.core.decision import Decision
from growpage.core.host_memory import MemoryFigure
from growpage.engine.llm import LLM
from growpage.engine.loading.loader import build_model
from growpage.engine.sampling_params import SamplingParams
from growpage.errors import EngineError, PolicyError
from growpage.policies import CapacityPolicy, GrowPagePolicy


@pytest.fixture(scope="module")
def model():
    return tiny_models()[0]


@pytest.mark.parametrize("policy", ["fullkv", "growpage", "shrink"])
def test_overcommitted_workload_finishes_and_returns_every_page(model, policy):
    kwargs = {"min_capacity_tokens": 8} if policy == "shrink" else {}
    llm = tiny_llm(model, policy, policy_kwargs=kwargs, kv_pages=20, max_num_seqs=6)
    # Each request fits the 20 pages (80 tokens) alone, with full KV; together they do not.
    prompts = [prompt(5 + 2 * i, 100 + i) for i in range(10)]
    params = [SamplingParams(max_tokens=20 + 4 * i, ignore_eos=True) for i in range(10)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [20 + 4 * i for i in range(10)]
    assert all(o.finish_reason == "length" for o in outs)
    assert all(0 <= t < 128 for o in outs for t in o.token_ids)
    stats = llm.last_stats
    assert stats.num_requests == 10 and stats.max_pages_used <= 20
    if policy == "fullkv":
        assert stats.num_preemptions > 0
    assert stats.avg_resident > 1
    assert_all_returned(llm)


@pytest.mark.parametrize("policy", ["growpage", "fixed"])
def test_a_pool_of_min_capacity_pages_serves_a_long_request(model, policy):
    kwargs = {"budget_tokens": 4} if policy == "fixed" else {}
    llm = tiny_llm(model, policy, policy_kwargs=kwargs, kv_pages=2)  # min_capacity pages
    out = llm.generate([prompt(3, 1)], GREEDY, use_tqdm=False)[0]  # grows to 2, compresses
    assert len(out.token_ids) == 40 and out.finish_reason == "length"
    assert out.events["forced_grow"] == 1 and out.events["compress"] > 0
    assert_all_returned(llm)


def test_fullkv_admits_a_request_whose_kv_fills_the_pool_exactly(model):
    # 16 pages of 4 tokens: 25 prompt + 40 output tokens leave 64 tokens of KV (the last output
    # token is never fed back), the whole pool; one more prompt token cannot fit.
    llm = tiny_llm(model, kv_pages=16)
    out = llm.generate([prompt(25, 3)], GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == 40 and out.num_preemptions == 0
    assert llm.last_stats.max_pages_used == 16
    assert_all_returned(llm)
    with pytest.raises(EngineError, match=r"request '\d+': 65 tokens \(prompt 26\) cannot fit"):
        llm.generate([prompt(26, 3)], GREEDY, use_tqdm=False)
    assert_all_returned(llm)


def test_bad_input_raises_clear_errors_and_engine_stays_usable(model, tmp_path):
    llm = tiny_llm(model, kv_pages=16)
    good = llm.generate([prompt(5, 1)], GREEDY, use_tqdm=False)[0].token_ids
    cases = [
        ([[]], GREEDY, "empty prompt"),
        ([prompt(5, 1), []], GREEDY, r"empty prompt \(prompts\[1\]\)"),
        ([prompt(5, 1), [5, "x"]], GREEDY, r"must be a list of ints \(prompts\[1\]\)"),
        ([prompt(70, 2)], GREEDY, "cannot fit"),  # 16 pages of 4 tokens
        ([prompt(30, 2)], GREEDY, "cannot fit"),  # fullkv: 30 + 40 tokens
        ([[5, 300]], GREEDY, r"token ids must lie in \[0, 128\)"),
        (["text"], GREEDY, "need a tokenizer"),
        ([prompt(5, 1)] * 2, [GREEDY], "one per prompt"),
        ([None], GREEDY, "a prompt is a string or a list of token ids, got NoneType"),
        (None, GREEDY, "prompts must be a string, a list of token ids or a list of those"),
        ([prompt(5, 1)], {"max_tokens": 3}, "params must be a SamplingParams or a list"),
        ([prompt(5, 1)], [{"max_tokens": 3}], "params must be SamplingParams, got dict"),
    ]
    for prompts, params, message in cases:
        with pytest.raises(EngineError, match=message):
            llm.generate(prompts, params, use_tqdm=False)
        assert_all_returned(llm)
    with pytest.raises(EngineError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(EngineError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(EngineError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(PolicyError, match="unknown policy"):
        tiny_llm(model, policy="no-such-policy")
    with pytest.raises(EngineError, match="not found"):
        LLM(str(tmp_path / "missing.gguf"))
    with pytest.raises(EngineError, match="fullkv"):
        tiny_llm(model, policy="growpage", record_traces=str(tmp_path / "t"))
    with pytest.raises(EngineError, match=r"empty continuation \(continuations\[1\]\)"):
        llm.score([prompt(5, 1)] * 2, [[5], []])
    assert llm.generate([prompt(5, 1)], GREEDY, use_tqdm=False)[0].token_ids == good
    assert llm.last_stats.num_requests == 1
    for bad in (lambda: llm.generate([[]], GREEDY), lambda: llm.score([None], [[5]])):
        with pytest.raises(EngineError):
            bad()
        assert llm.last_stats is None  # not the good call's
    # token ids as a tensor: [N] is one prompt, [B, N] is B of them
    assert llm.generate(torch.tensor(prompt(5, 1)), GREEDY, use_tqdm=False)[0].token_ids == good
    both = llm.generate(torch.tensor([prompt(5, 1)] * 2), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in both] == [good, good]
    # ... or numpy: an integer array, or a list of numpy integers
    assert llm.generate(np.array(prompt(5, 1)), GREEDY, use_tqdm=False)[0].token_ids == good
    numpy_ids = [np.int64(t) for t in prompt(5, 1)]
    assert llm.generate(numpy_ids, GREEDY, use_tqdm=False)[0].token_ids == good
    both = llm.generate(np.array([prompt(5, 1)] * 2, dtype=np.int32), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in both] == [good, good]
    scored = llm.score(np.array(prompt(5, 1)), [np.array(good[:3])])[0]
    assert scored.continuation_token_ids == good[:3] and len(scored.token_nlls) == 3
    with pytest.raises(EngineError, match="a list of token ids, got float"):
        llm.generate(np.array([1.5, 2.0]), GREEDY, use_tqdm=False)


def test_the_model_context_bounds_prompts_scores_and_generation():
    cfg = attrs.evolve(tiny_config("llama"), max_position=24)
    llm = tiny_llm(build_model(cfg, random_state_dict(cfg, seed=1234)), kv_pages=6)
    for n in (24, 30):
        with pytest.raises(
            EngineError,
            match=f"the prompt has {n} tokens; the model's context "
            "of 24 tokens leaves no room to generate",
        ):
            llm.generate([prompt(n, 1)], GREEDY, use_tqdm=False)
    with pytest.raises(
        EngineError,
        match=r"prompt \(20\) \+ continuation \(5\) = 25 tokens "
        "exceed the model's context of 24 tokens",
    ):
        llm.score([prompt(20, 1)], [prompt(5, 2)])
    assert_all_returned(llm)
    # fullkv in 6 pages of 4: prompt + 40 tokens would not fit, but generation stops at 24
    out = llm.generate([prompt(20, 1)], GREEDY, use_tqdm=False)[0]
    assert (len(out.token_ids), out.finish_reason) == (4, "length")
    assert len(llm.score([prompt(20, 1)], [prompt(4, 2)])[0].token_nlls) == 4
    assert_all_returned(llm)


def test_a_kv_cache_the_host_cannot_hold_is_an_engine_error(model, monkeypatch):
    from growpage.engine.modeling import attention

    monkeypatch.setattr(
        attention, "available_memory", lambda root: MemoryFigure(10**6, "cgroup v2 limit: ...")
    )
    with pytest.raises(
        EngineError,
        match=r"the KV cache would take 2097152 bytes \(0.00 GiB\) "
        r"for 1024 pages, but the host has 1000000 bytes "
        r"\(0.00 GiB\) available \(cgroup v2 limit: ",
    ):
        tiny_llm(model, kv_pages=1024)  # pages of 2048 bytes
    monkeypatch.setattr(attention, "available_memory", lambda root: None)  # torch refuses
    with pytest.raises(
        EngineError,
        match=r"cannot allocate the KV cache: 2251799813685248 "
        r"bytes .* on cpu \(.*\); lower kv_pages",
    ):
        tiny_llm(model, kv_pages=2**40)


def test_progress_bar_over_requests_or_the_tokens_of_a_lone_one(model, capsys, monkeypatch):
    llm = tiny_llm(model)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    llm.generate([prompt(5, 1)], params)
    assert capsys.readouterr().err == ""  # default: no bar for one prompt
    llm.generate([prompt(5, 1)], params, use_tqdm=True)
    err = capsys.readouterr().err
    assert "tokens: 100%" in err and "5/5" in err
    llm.generate([prompt(5, 1), prompt(6, 2)], params)
    assert capsys.readouterr().err == ""  # default: stderr is no terminal here (a log file)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    llm.generate([prompt(5, 1), prompt(6, 2)], params)
    err = capsys.readouterr().err
    assert "requests: 100%" in err and "2/2" in err  # default, on a terminal
    llm.generate([prompt(5, 1), prompt(6, 2)], params, use_tqdm=False)
    assert capsys.readouterr().err == ""


@attrs.define
class FailsOnce(CapacityPolicy):
    """Returns a malformed selection at its first compression, then behaves."""

    name = "fails-once"
    failed: bool = False

    def decide(self, ctx) -> Decision:
        return Decision.COMPRESS

    def select(self, ctx, keep: int) -> torch.Tensor:
        if not self.failed:
            self.failed = True
            return torch.zeros(1, dtype=torch.long)
        return super().select(ctx, keep)


def test_policy_error_mid_run_aborts_cleanly(model):
    llm = tiny_llm(model, FailsOnce())
    prompts = [prompt(9, 3), prompt(14, 4)]
    with pytest.raises(PolicyError, match="wrong shape"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_all_returned(llm)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == 40 for o in outs)
    assert llm.last_stats.events["compress"] > 0
    assert_all_returned(llm)


def test_first_boundary_before_any_decode_query_grows_without_the_policy(model):
    llm = tiny_llm(model, GrowPagePolicy())
    out = llm.generate(
        [prompt(8, 5)], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False
    )[0]
    # The prompt fills 2 pages exactly: the first generated token needs a page before any
    # decode query exists.
    assert out.events["forced_grow"] == 1 and out.events["decided_grow"] == 0
    assert out.trajectory == [(8, 3, "grow")]


# ---- a step that fails, then the engine stepped on ---------------------------------------------
def _serve_with_a_failed_forward(llm, prompts, params, fail_at: int):
    """Step ``llm``'s engine through ``prompts``, the forward of step ``fail_at`` failing once,
    then stepping on; the requests' output tokens."""
    engine = llm.engine
    seqs = [engine.add_request(str(i), ids, params) for i, ids in enumerate(prompts)]
    run, steps = engine.runner.run, [0]

    def failing(out):
        steps[0] += 1
        if steps[0] == fail_at:
            raise RuntimeError("device lost")
        return run(out)

    engine.runner.run = failing
    try:
        assert _step_to_the_end(engine, RuntimeError, "device lost") == 1
    finally:
        engine.runner.run = run
    return [seq.output_token_ids for seq in seqs]


def _step_to_the_end(engine, error: type[Exception], says: str) -> int:
    """Step ``engine`` until it has nothing left, going on after each ``error`` (its message
    holding ``says``); how many steps failed."""
    failed = 0
    while engine.has_unfinished():
        try:
            engine.step()
        except error as exc:
            assert says in str(exc)
            failed += 1
    return failed


@pytest.mark.parametrize("policy", ["fullkv", "fixed"])
@pytest.mark.parametrize("fail_at", [1, 2, 3, 7, 10])
@pytest.mark.parametrize("chunk", [8, 4096])
def test_a_failed_step_is_computed_again_and_the_tokens_are_a_clean_run_s(
    model, policy, fail_at, chunk
):
    """Whatever step fails (a prefill chunk, a decode step), the requests it had scheduled give
    back their slots and chunks, so stepping on computes them again at the same positions: the
    tokens are a clean run's, and no page that no forward computed enters the prefix cache
    (the same prompts served again from it get the same tokens). 10 steps, or 13 with prefill
    chunks of 8 tokens."""
    kwargs = {"policy_kwargs": {"budget_tokens": 12}} if policy == "fixed" else {}
    prompts = [prompt(13, 1), prompt(6, 2), prompt(9, 3)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    clean = tiny_llm(model, policy, max_num_batched_tokens=chunk, **kwargs)
    want = [o.token_ids for o in clean.generate(prompts, params, use_tqdm=False)]
    llm = tiny_llm(model, policy, max_num_batched_tokens=chunk, **kwargs)
    assert _serve_with_a_failed_forward(llm, prompts, params, fail_at) == want
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in again] == want
    if policy == "fullkv":  # (compressions rewrite their prompt pages, which leave the cache)
        assert all(o.num_cached_tokens > 0 for o in again)
    assert_all_returned(llm)


@attrs.define
class FixedFailingOnce(CapacityPolicy):
    """``fixed`` at 12 tokens whose ``fail_at``-th decision raises (once)."""

    name = "fixed-failing-once"
    fail_at: int = 3
    calls: list = attrs.field(factory=list)

    def decide(self, ctx):
        self.calls.append(ctx.request_id)
        if len(self.calls) == self.fail_at:
            raise RuntimeError("policy bug")
        return Decision.GROW if ctx.capacity < 12 else Decision.COMPRESS


@pytest.mark.parametrize("fail_at", [1, 2, 3, 5])
def test_a_scheduling_failure_gives_back_the_slots_it_had_given(model, fail_at):
    """A boundary that fails while a decode step is being scheduled, after other requests got
    their slots: those come back, and stepping on serves a clean run's tokens."""
    prompts = [prompt(6, 4), prompt(7, 5), prompt(5, 6)]
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    clean = tiny_llm(model, FixedFailingOnce(fail_at=0))
    want = [o.token_ids for o in clean.generate(prompts, params, use_tqdm=False)]
    llm = tiny_llm(model, FixedFailingOnce(fail_at=fail_at))
    engine = llm.engine
    seqs = [engine.add_request(str(i), ids, params) for i, ids in enumerate(prompts)]
    assert _step_to_the_end(engine, PolicyError, "policy bug") == 1
    assert [seq.output_token_ids for seq in seqs] == want
    assert_all_returned(llm)


@pytest.mark.parametrize("watermark", [0, 1, 2])
def test_a_policy_that_never_compresses_is_refused_up_front_when_the_watermark_bars_it(
    model, watermark
):
    """fullkv needs every token's KV; its growth leaves the pool's watermark free, so a request
    that would need those pages is refused when it is added, not aborted half-way."""
    llm = tiny_llm(
        model,
        page_size=2,
        recent_window=1,
        kv_pages=26,
        watermark=watermark,
        enable_prefix_caching=False,
    )
    ids = prompt(23, 8)  # 23 + 28 - 1 = 50 tokens of KV at the end: 25 pages of 2
    params = SamplingParams(max_tokens=28, ignore_eos=True)
    if watermark <= 1:
        (out,) = llm.generate([ids], params, use_tqdm=False)
        assert len(out.token_ids) == 28 and out.num_preemptions == 0
    else:
        with pytest.raises(
            EngineError,
            match="50 tokens .*26 pages of 2 tokens, 2 of them kept free as the pool's watermark",
        ):
            llm.generate([ids], params, use_tqdm=False)
    assert_all_returned(llm)


def test_inputs_the_engine_audit_found_are_refused_by_name_and_the_llm_stays_usable(
    model, tmp_path
):
    from growpage.core.config import GrowPageConfig
    from growpage.errors import ConfigError

    llm = tiny_llm(model, "fullkv", kv_pages=64)
    good = [prompt(5, 1)]

    def usable():
        assert (
            len(llm.generate(good, SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids) == 2
        )
        assert_all_returned(llm)

    # A temperature so small that logits / T overflow used to make torch.multinomial fail on
    # nan probabilities; below 1e-5 it decodes greedily.
    greedy = llm.generate(good, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    for t in (1e-40, 1e-46, 5e-324, 9e-6):
        tiny_t = llm.generate(
            good,
            SamplingParams(max_tokens=6, ignore_eos=True, temperature=t, seed=3),
            use_tqdm=False,
        )
        assert tiny_t[0].token_ids == greedy[0].token_ids, t
    cases = [
        (lambda: llm.generate(good, []), "give one SamplingParams or one per prompt (1), got 0"),
        (lambda: llm.stream(good, ()), "give one SamplingParams or one per prompt (1), got 0"),
        (lambda: llm.score(good, [[10**9]]), "continuation token ids must lie in [0, 128)"),
        (
            lambda: llm.score(good * 2, [[3], [10**9]]),
            "continuation token ids must lie in [0, 128) (continuations[1])",
        ),
        (lambda: llm.score(good, b"ab"), "continuations must be a string, a list of token ids"),
        (lambda: llm.score(good, [[-5]]), "continuation token ids must lie in [0, 128)"),
        (lambda: llm.generate(b"hello"), "got bytes (decode them to a string first)"),
        (lambda: llm.generate([b"hi", [3, 4]]), "got bytes (prompts[0]) (decode bytes"),
        (
            lambda: llm.generate([[1, 2], [10**9]], SamplingParams(max_tokens=2)),
            "token ids must lie in [0, 128) (prompts[1])",
        ),
        (lambda: llm.generate(good, chat="yes"), "chat must be True or False, got str 'yes'"),
    ]
    for call, message in cases:
        with pytest.raises(EngineError) as info:
            call()
        assert message in str(info.value), (message, str(info.value))
        usable()
    llm.generate([], use_tqdm=False)  # an empty call has statistics, all zero
    assert llm.last_stats is not None and llm.last_stats.num_requests == 0
    assert (
        SamplingParams(
            max_tokens=np.int64(3), temperature=np.float32(0.5), stop_token_ids=np.array([1, 2])
        ).max_tokens
        == 3
    )
    with pytest.raises(
        EngineError, match="stop must be a string or a list of strings, got {'a': 1}"
    ):
        SamplingParams(stop={"a": 1})
    bad_llms = [
        ({"dtype": torch.int8}, "EngineConfig.dtype: torch.int8 is not supported"),
        ({"config": "x"}, "LLM(config=...) takes a GrowPageConfig, got str"),
        ({"policy_kwargs": [1]}, "LLM(policy_kwargs=...) takes a dict"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be True or False"),
        (
            {"record_traces": str(tmp_path / "t"), "record_layers": "01"},
            "record_layers must be a list of layer indices or None, got '01'",
        ),
        ({"warmup": "yes"}, "warmup must be True, False or None"),
        ({"record_values": 1}, "record_values must be True or False"),
        ({"record_layers": [0]}, "record_layers ([0]) picks the layers that record_traces"),
    ]
    for kwargs, message in bad_llms:
        with pytest.raises(ConfigError) as info:
            LLM(model, policy="fullkv", **kwargs)
        assert message in str(info.value), (message, str(info.value))
    for layers in (np.array([1, 0]), (i for i in [1, 0]), map(int, "10"), range(2)):
        recorded = LLM(
            model,
            policy="fullkv",
            config=GrowPageConfig(page_size=4, recent_window=2),
            record_traces=str(tmp_path / "t"),
            record_layers=layers,
        ).config.record_layers
        assert recorded == (0, 1) and all(type(i) is int for i in recorded)
    flags = LLM(model, policy="fullkv", enable_prefix_caching=np.True_, warmup=np.False_).config
    assert flags.enable_prefix_caching is True and flags.warmup is False
    from growpage.engine.config import EngineConfig

    assert EngineConfig(dtype=torch.float64).dtype == torch.float64
    assert (
        len(
            llm.generate(good, SamplingParams(max_tokens=2), chat=np.False_, use_tqdm=False)[
                0
            ].token_ids
        )
        == 2
    )
    from collections import deque

    for stops in (
        (s for s in ["a", "b"]),
        np.array(["a", "b"]),
        {"a": 0, "b": 1}.keys(),
        deque(["a", "b"]),
    ):
        assert SamplingParams(stop=stops).stop == ("a", "b")
