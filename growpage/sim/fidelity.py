"""Fidelity of a retained KV set, measured with the real attention of future queries.

After a boundary at position ``t`` the next page of queries (positions ``t .. t+b-1``) will attend
over the resident tokens plus the tokens they write themselves. With full KV they would attend
over every past token. ``FutureAttention`` computes, once per boundary and for a sample of those
queries, the real attention over all past keys (post-RoPE query at its own position, causal);
``lost_mass`` and ``output_error`` then score any retained set against it (paper Eq. 3 and 5):

* retained mass ``m = 1 - lost``: attention the future query puts on the kept tokens, per layer
  and KV head (mean over the KV head's query group, as ``core.demand`` does for GQA);
* output error ``|o - o_hat|_2``: full attention output vs the output renormalized over the kept
  tokens, per query head (needs recorded values).

Lost mass is summed over the dropped tokens only, so a set that drops nothing scores exactly 1.
"""

from __future__ import annotations

import attrs
import torch

from growpage.core.demand import coverage_demand
from growpage.core.rope import apply_rope, cos_sin
from growpage.sim.traceview import TraceView


def sample_positions(start: int, end: int, num: int) -> torch.Tensor:
    """Up to ``num`` positions spread evenly over ``[start, end)`` (all of them if fewer)."""
    if end - start <= num:
        return torch.arange(start, end)
    return torch.linspace(start, end - 1, num).round().long().unique()


@attrs.define(eq=False)
class FutureAttention:
    """Real attention of sampled future queries of one boundary.

    Attributes:
        boundary: the boundary position t; keys ``< t`` are the ones a policy may have dropped.
        positions: ``[Q]`` sampled query positions in ``[t, t + b)``.
        probs: ``[L, Hkv, G * Q, K]`` softmax of each query head (group-major) over keys
            ``0 .. K-1`` (``K = positions[-1] + 1``; zero beyond each query's own position).
        values: ``[L, Hkv, K, d]`` or None.
    """

    boundary: int
    positions: torch.Tensor
    probs: torch.Tensor
    values: torch.Tensor | None
    _full: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)

    @classmethod
    def compute(cls, view: TraceView, boundary: int, end: int, num_queries: int) -> FutureAttention:
        trace = view.trace
        pos = sample_positions(boundary, end, num_queries)
        num_layers, num_kv = view.num_layers, view.num_kv_heads
        cos, sin = cos_sin(trace.header.rope, pos)  # [Q, d]
        q = trace.queries[:, pos].float()  # [L, Q, Hq, d]
        q = apply_rope(q, cos[None, :, None], sin[None, :, None]) * view.softmax_scale
        q = q.permute(0, 2, 1, 3).reshape(num_layers, num_kv, -1, q.shape[-1])  # [L, Hkv, G*Q, d]
        k_len = int(pos[-1]) + 1
        keys = view.keys_by_head[:, :, :k_len]  # [L, Hkv, K, d]
        probs = torch.matmul(q, keys.transpose(-1, -2))  # [L, Hkv, G*Q, K]
        future = torch.arange(k_len).view(1, -1) > pos.view(-1, 1)  # [Q, K]
        probs.masked_fill_(future.repeat(q.shape[2] // len(pos), 1), float("-inf"))
        probs.sub_(probs.amax(dim=-1, keepdim=True)).exp_()  # softmax, in place
        probs.div_(probs.sum(dim=-1, keepdim=True))
        values = None if view.values_by_head is None else view.values_by_head[:, :, :k_len]
        return cls(boundary, pos, probs, values)

    @property
    def num_queries(self) -> int:
        return len(self.positions)

    def dropped(self, resident: torch.Tensor) -> torch.Tensor:
        """``[L, Hkv, K]`` fp32 0/1: positions before the boundary not in ``resident [L, Hkv, N]``."""
        num_layers, num_kv, _, k_len = self.probs.shape
        mask = torch.zeros(num_layers, num_kv, k_len)
        mask[:, :, : self.boundary] = 1.0
        return mask.scatter_(2, resident.to(torch.long), 0.0)

    def _lost_per_head(self, drop: torch.Tensor) -> torch.Tensor:
        """``[L, Hkv, G*Q]`` mass each query head puts on the dropped tokens."""
        return torch.matmul(self.probs, drop.unsqueeze(-1)).squeeze(-1)

    def _group_mean(self, x: torch.Tensor) -> torch.Tensor:
        """``[L, Hkv, G*Q]`` -> ``[L, Hkv, Q]``: mean over each KV head's query group."""
        return x.unflatten(-1, (-1, self.num_queries)).mean(dim=-2)

    def lost_mass(self, resident: torch.Tensor) -> torch.Tensor:
        """``[L, Hkv, Q]`` attention mass the future queries would put on dropped tokens."""
        return self._group_mean(self._lost_per_head(self.dropped(resident)))

    def output_error(self, resident: torch.Tensor) -> torch.Tensor | None:
        """``[L, Hkv, Q]`` float64 mean over the query group of ``|o - o_hat|_2``, or None
        without values.

        NOTE: ``o_hat`` is the kept tokens' output divided by their own mass, both summed over
        the kept tokens. Taking them as ``o`` and ``1`` less the dropped tokens' share cancels
        to float32 rounding noise when the dropped tokens held nearly all the mass (an attention
        sink dropped): ``o_hat`` came out thousands of times too large.

        NOTE: the outputs are divided by a power of two near their largest entry (exact) before
        ``o - o_hat`` and its norm, and the norm multiplied back in float64: with values as
        large as fp32 or bf16 hold (~1e20 squared, or ``o - o_hat`` itself past 3.4e38) a
        finite trace still gets a finite error, and other traces the same one as unscaled."""
        if self.values is None:
            return None
        kept_probs = self.probs * (1.0 - self.dropped(resident)).unsqueeze(-2)
        kept = kept_probs.sum(dim=-1, keepdim=True)  # [L, Hkv, G*Q, 1]
        full = self._full_output()
        # A query's own token is always kept, so ``kept`` is 0 only where it underflowed;
        # its output is then 0 too and ``o_hat`` reads 0.
        approx = torch.matmul(kept_probs, self.values) / kept.clamp_min(
            torch.finfo(kept.dtype).tiny
        )
        scale = _power_of_two_above(
            torch.maximum(
                full.abs().amax(dim=-1, keepdim=True), approx.abs().amax(dim=-1, keepdim=True)
            )
        )
        err = (full / scale - approx / scale).norm(dim=-1).double() * scale.squeeze(-1).double()
        return self._group_mean(err)

    def _full_output(self) -> torch.Tensor:
        """``[L, Hkv, G*Q, d]`` full-KV output, once per boundary (every retained set scored
        against it). Normalized as ``o_hat`` is (its mass is 1 up to rounding), so that a set
        that drops nothing gets ``o_hat == o`` exactly: an error of exactly 0."""
        if self._full is None:
            assert self.values is not None  # output_error's
            self._full = torch.matmul(self.probs, self.values) / self.probs.sum(
                dim=-1, keepdim=True
            )
        return self._full

    def working_set_ratio(self, p: float) -> float:
        """Mean top-p working-set ratio (Eq. 7) of the sampled queries over their full history."""
        attn = self.probs.unflatten(2, (-1, self.num_queries)).mean(dim=2)  # [L, Hkv, Q, K]
        counts = coverage_demand(attn, p).float()  # [L, Hkv, Q]
        return float((counts / (self.positions.float() + 1)).mean())


def _power_of_two_above(x: torch.Tensor) -> torch.Tensor:
    """The power of two ``2^e`` with ``x < 2^e <= 2x`` for each ``x > 0`` (1 where ``x`` is 0):
    dividing by it is exact and brings ``x`` into ``[0.5, 1)``."""
    exponent = torch.frexp(x).exponent  # x = m 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(x), exponent)


@attrs.frozen
class Fidelity:
    """Fidelity of one retained set at one boundary.

    ``head_mass`` is ``[L, Hkv]``: retained mass per layer and KV head, averaged over the sampled
    future queries; ``mass_mean`` / ``mass_min`` are its mean and minimum.
    """

    head_mass: torch.Tensor
    mass_mean: float
    mass_min: float
    output_error: float | None

    @classmethod
    def of(
        cls, future: FutureAttention, resident: torch.Tensor, with_error: bool = True
    ) -> Fidelity:
        head_mass = 1.0 - future.lost_mass(resident).mean(dim=-1)
        err = future.output_error(resident) if with_error else None
        return cls(
            head_mass,
            float(head_mass.mean()),
            float(head_mass.min()),
            None if err is None else float(err.mean()),
        )
