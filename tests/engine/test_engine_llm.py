"""``LLM`` on the tiny model under ``fullkv``: token-identical to transformers, whatever the
batching, chunking, prefix caching or preemption; teacher-forced scoring."""

from __future__ import annotations

import pytest
import torch
from llm_helpers import (
    GREEDY,
    assert_all_returned,
    hf_greedy,
    hf_nll,
    prompt,
    tiny_llm,
    tiny_models,
)

from growpage.engine.sampling_params import SamplingParams

PROMPTS = [prompt(3, 1), prompt(9, 2), prompt(17, 3), prompt(30, 4), prompt(12, 5)]


@pytest.fixture(scope="module")
def models():
    return tiny_models()


@pytest.fixture(scope="module")
def expected(models):
    """Reference greedy continuations (40 tokens) from transformers."""
    return [hf_greedy(models[1], p, 40) for p in PROMPTS]


@pytest.mark.parametrize(
    "settings",
    [
        {},  # one prefill step, then decode
        {"max_num_batched_tokens": 8, "max_num_seqs": 2},  # chunked prefill, staggered admission
        {"page_size": 16, "recent_window": 4},
    ],
)
def test_fullkv_greedy_mixed_batch_identical_to_transformers(models, expected, settings):
    llm = tiny_llm(models[0], **settings)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.last_stats.num_output_tokens == 40 * len(PROMPTS)
    assert llm.last_stats.events["compress"] == 0 and llm.last_stats.events["grow"] > 0
    assert_all_returned(llm)


def test_prefix_caching_on_and_off_identical(models):
    shared = prompt(21, 7)
    prompts = [shared + prompt(n, 10 + n) for n in (1, 4, 9)] + [shared]
    off = tiny_llm(models[0], enable_prefix_caching=False)
    on = tiny_llm(models[0])
    expected = [o.token_ids for o in off.generate(prompts, GREEDY, use_tqdm=False)]
    first = on.generate(prompts[:1], GREEDY, use_tqdm=False)  # fills the cache
    assert first[0].token_ids == expected[0]
    outs = on.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    # Pages 0..4 (20 tokens) of the shared prefix hit; the prompt equal to the prefix recomputes
    # its last page (its last token needs logits).
    assert [o.num_cached_tokens for o in outs] == [20, 20, 20, 20]
    assert on.last_stats.prefix_hit_tokens == 80
    assert_all_returned(on)


def test_prompts_sharing_a_page_each_keep_their_own_cached_pages(models):
    """Two prompts share their first page (4 tokens) and differ after it. A hit on the shared
    page must not forget the other prompt's later pages, and two such prompts prefilled in one
    step both get their later pages cached (the second's chained to the first's equal page)."""
    shared = prompt(4, 3)
    a, b = shared + prompt(5, 4), shared + prompt(5, 5)  # pages: shared, own, partial
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    llm = tiny_llm(models[0])

    def cached(*prompts):
        return [o.num_cached_tokens for o in llm.generate(list(prompts), one, use_tqdm=False)]

    assert [cached(p)[0] for p in (a, a, b, b, a)] == [0, 8, 4, 8, 8]
    fresh = tiny_llm(models[0])
    assert [o.num_cached_tokens for o in fresh.generate([a, b], one, use_tqdm=False)] == [0, 0]
    assert [o.num_cached_tokens for o in fresh.generate([b], one, use_tqdm=False)] == [8]
    assert [o.num_cached_tokens for o in fresh.generate([a], one, use_tqdm=False)] == [8]
    assert_all_returned(llm)
    assert_all_returned(fresh)


def test_forced_preemption_gives_identical_greedy_output(models, expected):
    # 24 pages of 4 tokens hold ~2 of these requests at full length: the rest are preempted
    # and recomputed, possibly several times.
    llm = tiny_llm(models[0], kv_pages=24)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    stats = llm.last_stats
    assert (
        stats.num_preemptions > 0 and sum(o.num_preemptions for o in outs) == stats.num_preemptions
    )
    assert outs[0].num_preemptions == 0  # victims are the most recently admitted requests
    assert stats.events["preempt_needed"] > 0
    assert stats.max_pages_used <= 24
    assert_all_returned(llm)


def test_score_fullkv_matches_transformers_nll(models):
    llm = tiny_llm(models[0])
    conts = [prompt(25, 50), prompt(7, 51)]
    outs = llm.score(PROMPTS[:2], conts)
    for p, c, out in zip(PROMPTS[:2], conts, outs, strict=True):
        assert out.continuation_token_ids == c
        ref = hf_nll(models[1], p, c)
        assert out.token_nlls == pytest.approx(ref, abs=1e-4)
        assert out.mean_nll == pytest.approx(sum(ref) / len(ref), abs=1e-4)
    assert_all_returned(llm)


def test_score_ranks_match_transformers_and_greedy_output(models):
    llm = tiny_llm(models[0])
    greedy = llm.generate(PROMPTS[:2], GREEDY.replace(max_tokens=12), use_tqdm=False)
    outs = llm.score(PROMPTS[:2], [g.token_ids for g in greedy])
    assert all(o.token_ranks == [0] * 12 and o.greedy_match() for o in outs)
    cont = prompt(15, 52)
    out = llm.score(PROMPTS[2], cont)[0]
    seq = torch.tensor([PROMPTS[2] + cont])
    logits = models[1](seq).logits[0].float()[len(PROMPTS[2]) - 1 : -1]
    want = (logits > logits.gather(1, torch.tensor(cont)[:, None])).sum(1).tolist()
    assert out.token_ranks == want and max(want) > 0
    assert out.greedy_match(0, want.index(max(want))) == all(
        r == 0 for r in want[: want.index(max(want))]
    )
    assert not out.greedy_match()


def test_score_under_preemption_matches_unconstrained(models):
    conts = [prompt(30, 60 + i) for i in range(len(PROMPTS))]
    free = tiny_llm(models[0]).score(PROMPTS, conts)
    tight = tiny_llm(models[0], kv_pages=24)
    outs = tight.score(PROMPTS, conts)
    assert tight.last_stats.num_preemptions > 0
    for a, b in zip(free, outs, strict=True):
        assert b.token_nlls == pytest.approx(a.token_nlls, abs=1e-4)


def test_score_under_growpage_compresses_and_differs(models):
    conts = [prompt(60, 70)]
    full = tiny_llm(models[0]).score(PROMPTS[3:4], conts)[0]
    llm = tiny_llm(models[0], policy="fixed", policy_kwargs={"budget_tokens": 24})
    out = llm.score(PROMPTS[3:4], conts)[0]
    assert out.events["compress"] > 0
    first = out.trajectory[0][0] if out.trajectory else None
    assert first is not None
    n = first - len(PROMPTS[3])  # tokens scored before the first compression are identical
    assert out.token_nlls[:n] == pytest.approx(full.token_nlls[:n], abs=1e-4)
    assert out.token_nlls != pytest.approx(full.token_nlls, abs=1e-4)
    assert all(x >= 0 for x in out.token_nlls)


def test_sampling_is_seeded_and_respects_stop_tokens(models):
    llm = tiny_llm(models[0])
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=3, ignore_eos=True)
    a = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    b = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    c = llm.generate(PROMPTS[:2], params.replace(seed=4), use_tqdm=False)
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    stop = a[0].token_ids[5]
    d = llm.generate(PROMPTS[0], params.replace(stop_token_ids=(stop,)), use_tqdm=False)[0]
    assert d.finish_reason == "stop" and d.token_ids[-1] == stop and stop not in d.token_ids[:-1]
    assert_all_returned(llm)


def test_llms_sharing_one_model_each_use_their_own_cache(models, expected):
    """Two engines over one ``CausalLM`` (different page sizes, so different caches), used in
    turn: each step runs on its own engine's cache and backend."""
    first = tiny_llm(models[0])
    second = tiny_llm(models[0], page_size=16, recent_window=4)  # binds the model to its cache
    for llm in (first, second, first):
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == expected
        assert_all_returned(llm)
    assert models[0].kv_cache is first.engine.kv.cache


def test_an_llm_refuses_a_shared_model_moved_to_another_dtype(models):
    from growpage.engine.loading.loader import build_model
    from growpage.errors import EngineError

    model = build_model(models[0].config, models[0].state_dict())
    first = tiny_llm(model)
    tiny_llm(model, dtype="bfloat16")  # moves the shared model to bf16 in place
    with pytest.raises(EngineError, match="another LLM moved the shared CausalLM"):
        first.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
