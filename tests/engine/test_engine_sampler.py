"""``Sampler``: greedy rows picked where the logits are, sampled rows drawn on the host; bad
``SamplingParams`` and seeds are errors naming the field."""

from __future__ import annotations

import pytest
import torch

from growpage.engine.config import EngineConfig
from growpage.engine.loop.sampler import Sampler, top_p_filter
from growpage.engine.sampling_params import SamplingParams
from growpage.errors import ConfigError, EngineError


def test_a_mixed_batch_matches_row_by_row_draws():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen) * 3
    greedy = SamplingParams()
    params = [
        greedy,
        SamplingParams(temperature=0.7, top_p=0.9, seed=11),
        greedy,
        SamplingParams(temperature=1.3, seed=12),
        greedy,
    ]
    tokens = Sampler(seed=0).sample(logits, [0, 1, 2, 3, 4], params)
    for i in (0, 2, 4):
        assert tokens[i] == int(logits[i].argmax())
    for i in (1, 3):  # the same draw as a lone row with the request's own generator
        p = params[i]
        probs = top_p_filter(torch.softmax(logits[i] / p.temperature, dim=-1), p.top_p)
        want = int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(p.seed)))
        assert tokens[i] == want


def test_greedy_ties_go_to_the_first_index():
    logits = torch.zeros(2, 8)
    logits[0, [3, 6]] = 1.0
    assert Sampler().sample(logits, [0, 1], [SamplingParams(), SamplingParams()]) == [3, 0]


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("temperature", float("nan"), "temperature must be a finite number >= 0, got nan"),
        ("top_p", 0, r"top_p must be a number in \(0, 1\], got 0"),
        ("max_tokens", True, "max_tokens must be a positive integer, got True"),
        ("seed", 2**64, r"seed must be an integer in \[-2\*\*63, 2\*\*64\) or None, got 18446"),
        ("seed", -(2**63) - 1, r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"),
        ("stop", 5, "stop must be a string or a list of strings, got 5"),
        ("stop", [5], "stop must be non-empty strings"),
        ("stop", ["ok", "\udcff"], "stop must be non-empty strings of valid Unicode text"),
        ("stop_token_ids", 5, "stop_token_ids must be a list of token ids, got 5"),
        ("ignore_eos", "no", "ignore_eos must be True or False, got 'no'"),
    ],
)
def test_bad_sampling_params_name_the_field(field, value, words):
    with pytest.raises(EngineError, match=r"^SamplingParams\." + words):
        SamplingParams(**{field: value})


def test_every_accepted_seed_seeds_a_generator():
    for seed in (-(2**63), 2**64 - 1):
        params = SamplingParams(temperature=1.0, seed=seed)
        assert Sampler(seed=seed).sample(torch.zeros(1, 4), [0], [params])[0] in range(4)
    with pytest.raises(ConfigError, match=r"EngineConfig.seed must be an integer in \[-2\*\*63"):
        EngineConfig(seed=2**64)


def test_llm_page_size_of_the_wrong_type_is_a_config_error(monkeypatch):
    from growpage.engine import llm as llm_module

    monkeypatch.setattr(llm_module, "_load", lambda *a: pytest.fail("model loaded"))
    with pytest.raises(
        ConfigError, match="GrowPageConfig.page_size must be a positive integer, got '16'"
    ):
        llm_module.LLM(page_size="16")
