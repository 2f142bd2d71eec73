"""The counterfactual NLL of a reference under a kept KV state equals what the engine's own
paged path gives: teacher-forced scoring with one compression at that boundary."""

from __future__ import annotations

import attrs
import pytest
import torch
from llm_helpers import prompt, tiny_llm, tiny_model

from growpage import CapacityPolicy, Decision
from growpage.engine.counterfactual import reference
from growpage.errors import EngineError

B, R = 4, 2


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@attrs.define(slots=False)
class CompressOnceAt(CapacityPolicy):
    """Grows at every boundary but the one at ``position``, where it keeps ``kept`` (slots are
    positions: nothing was compressed before)."""

    position: int
    kept: torch.Tensor
    fallback_to_compress = False

    def decide(self, ctx):
        return Decision.COMPRESS if ctx.position == self.position else Decision.GROW

    def select(self, ctx, keep):
        assert keep == self.kept.shape[-1]
        return self.kept.clone()


def random_kept(num_layers, num_kv, start, seed):
    """Per layer and KV head, ``start - B`` positions of ``[0, start)`` with the recent window."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_layers * num_kv):
        chosen = torch.randperm(start - R, generator=gen)[: start - B - R].sort().values
        rows.append(torch.cat([chosen, torch.arange(start - R, start)]))
    return torch.stack(rows).view(num_layers, num_kv, start - B)


@pytest.mark.parametrize("start, seed", [(12, 0), (20, 1), (24, 2)])
def test_kept_nll_equals_the_engines_scoring_with_that_compression(model, start, seed):
    head = prompt(7, 90 + seed)
    tail = prompt(30, 190 + seed)
    ref = reference(model, head + tail)
    cfg = model.config
    kept = random_kept(cfg.num_layers, cfg.num_kv_heads, start, seed)
    got = ref.nll_kept(start, kept, B)
    llm = tiny_llm(model, CompressOnceAt(start, kept), enable_prefix_caching=False)
    [scored] = llm.score([head], [tail])
    assert scored.events["compress"] == 1
    j = start + 1 - len(head)  # continuation index of token start + 1
    engine = torch.tensor(scored.token_nlls[j : j + B])
    torch.testing.assert_close(got, engine, rtol=1e-4, atol=1e-4)
    # Everything kept: the reference's own NLLs; and the compression changed them.
    everything = torch.arange(start).expand(cfg.num_layers, cfg.num_kv_heads, start)
    torch.testing.assert_close(
        ref.nll_kept(start, everything, B), ref.nlls[start : start + B], rtol=1e-4, atol=1e-4
    )
    assert not torch.allclose(got, ref.nlls[start : start + B], atol=1e-3)
    full = tiny_llm(model).score([head], [tail])[0]
    torch.testing.assert_close(
        ref.nlls[len(head) - 1 :], torch.tensor(full.token_nlls), rtol=1e-4, atol=1e-4
    )


def test_bad_counterfactuals_are_refused(model):
    ref = reference(model, prompt(20, 5))
    cfg = model.config
    kept = torch.zeros(cfg.num_layers, cfg.num_kv_heads, 3, dtype=torch.long)
    with pytest.raises(EngineError, match="cannot score 4 tokens after position 18"):
        ref.nll_kept(18, kept, 4)
    with pytest.raises(EngineError, match=r"kept must be \[L="):
        ref.nll_kept(8, kept[0], 4)
    with pytest.raises(EngineError, match=r"kept positions must lie in \[0, 8\)"):
        ref.nll_kept(8, kept + 8, 4)
