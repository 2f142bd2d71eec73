"""``Sampler``: next tokens from logits (greedy, temperature, top-p), and forced tokens' log-probs."""

from __future__ import annotations

import torch

from growpage.engine.loop.transfer import to_device
from growpage.engine.sampling_params import GREEDY_BELOW, SamplingParams


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of top tokens whose mass reaches ``top_p``; ``[V]``."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs  # mass strictly before each token
    sorted_probs[before >= top_p] = 0.0
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)


class Sampler:
    """Draws one token per sequence; each request with a seed owns its generator."""

    def __init__(self, seed: int = 0) -> None:
        self._default = torch.Generator().manual_seed(seed)
        self._generators: dict[int, torch.Generator] = {}

    def _generator(self, seq_id: int, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._default
        if seq_id not in self._generators:
            self._generators[seq_id] = torch.Generator().manual_seed(params.seed)
        return self._generators[seq_id]

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def sample(
        self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams]
    ) -> list[int]:
        """``logits [B, V]`` (fp32) -> one token id per row.

        Greedy picks are made where the logits are (on a GPU only ``B`` ids cross to the host,
        not ``B x V`` logits); rows that sample are copied to the host and drawn there with the
        request's CPU generator, so a seed gives the same tokens on every device.
        """
        logits = logits.float()
        tokens = logits.argmax(dim=-1).tolist()  # the step's one host sync
        sampled = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
        if not sampled:  # (not p.is_greedy, without a property call per row)
            return tokens
        rows = logits[sampled].cpu()
        for j, i in enumerate(sampled):
            p = params[i]
            probs = torch.softmax(rows[j] / p.temperature, dim=-1)
            probs = top_p_filter(probs, p.top_p)
            gen = self._generator(seq_ids[i], p)
            tokens[i] = int(torch.multinomial(probs, 1, generator=gen))
        return tokens

    @staticmethod
    def logprobs(logits: torch.Tensor, token_ids: list[int]) -> tuple[list[float], list[int]]:
        """Log-probability of ``token_ids[i]`` under row ``i`` of ``logits [B, V]``, and its
        rank there (0 = the greedy choice; ties with the chosen token do not count)."""
        logits = logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        index = to_device(token_ids, torch.long, logp.device).unsqueeze(1)
        chosen = logits.gather(1, index)
        ranks = (logits > chosen).sum(dim=1)
        # One host sync for both: fp32 log-probs and integer ranks (< 2**53) are exact in fp64.
        both = torch.stack([logp.gather(1, index).squeeze(1).double(), ranks.double()])
        values, counts = both.tolist()
        return values, [int(r) for r in counts]
