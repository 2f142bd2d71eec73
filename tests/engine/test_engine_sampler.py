"""``Sampler``: greedy rows picked where the logits are, sampled rows drawn on the host."""

from __future__ import annotations

import torch

from growpage.engine.sampler import Sampler, top_p_filter
from growpage.engine.sampling_params import SamplingParams


def test_a_mixed_batch_matches_row_by_row_draws():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen) * 3
    greedy = SamplingParams()
    params = [greedy, SamplingParams(temperature=0.7, top_p=0.9, seed=11), greedy,
              SamplingParams(temperature=1.3, seed=12), greedy]
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
