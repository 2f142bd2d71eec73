"""Synthetic traces: attention that switches between concentrated and diffuse regimes.

Paper Fig. 3: during decoding a request's attention repeatedly moves between *concentrated*
regimes (a few anchor tokens take almost all the mass: small top-p working set) and *diffuse*
regimes (mass spread over the history: large working set). ``synthetic_trace`` builds a trace in
the ordinary trace format whose real softmax attention has exactly that shape, so tests and large
simulated workloads need no model.

Construction (per recorded layer and KV head; the regime schedule is shared by all of them):

* The lowest-frequency quarter of the rotary pairs is a *codebook*: ``M = 2 * (d // 8)``
  orthogonal directions ``c_m`` (standard basis vectors of those dims).
* Keys are stored post-RoPE: every key is noise ``N(0, diffuse_std^2)``; the anchor tokens of a
  concentrated regime get ``A * c_m`` on top, with ``m`` the regime's direction and ``A`` chosen
  so that the anchors' logits exceed the bulk by ``concentration`` nats.
* A query is ``0.9 * |q| * c_m`` (post-RoPE) plus a remainder in the non-codebook dims in a
  concentrated regime, and only the remainder in a diffuse one (same norm ``|q| = sqrt(d)`` in
  both, as after a q-norm). The remainder is a fixed per-head direction plus per-token noise;
  keys are isotropic there, so it gives logits of std ``diffuse_std``. The codebook part is
  stored pre-RoPE as ``RoPE(-t) (alpha c_m)``, so the post-RoPE logits are exactly as designed.
  Because the codebook sits in the slowest rotary pairs, the pre-RoPE queries of a regime barely
  rotate, and their EMAs (GrowPage's query summaries) follow the regimes as in a real model.

Ground truth is stored in ``header.meta["regimes"]``: ``[[start, end, kind], ...]`` covering
``[0, T)`` with kind ``"prompt"`` (diffuse queries), ``"concentrated"`` or ``"diffuse"``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import attrs
import torch

from growpage.core.rope import RopeConfig, apply_rope, inv_frequencies
from growpage.core.trace_set import TraceSet
from growpage.core.traces import Trace, TraceHeader
from growpage.validators import check, flag, in_range, one_of, positive_int, positive_number

SCHEDULES = ("random", "switch", "reverse_switch", "concentrated", "diffuse")
VOCAB_SIZE = 49152  # token ids are drawn from [0, VOCAB_SIZE) (SmolLM2's vocabulary)
QUERY_ANCHOR_FRACTION = 0.9  # share of a concentrated query's norm along its codebook direction
QUERY_BASE_SHARE = 0.5  # share of the non-codebook query energy in a fixed per-head direction


@attrs.frozen(kw_only=True)
class SyntheticSpec:
    """Shape and regime parameters of a synthetic trace (docs/trace-format.md lists them)."""

    num_layers: int = attrs.field(default=2, validator=positive_int)  # recorded layers
    num_q_heads: int = attrs.field(default=4, validator=positive_int)
    num_kv_heads: int = attrs.field(default=2, validator=positive_int)
    head_dim: int = attrs.field(default=64, validator=positive_int)  # even, >= 8
    prompt_len: int = attrs.field(default=64, validator=positive_int)  # tokens
    gen_len: int = attrs.field(default=448, validator=positive_int)  # tokens
    rope_theta: float = attrs.field(default=10000.0, validator=positive_number)
    schedule: str = attrs.field(default="random", validator=one_of(SCHEDULES))
    mean_regime_len: float = attrs.field(default=512.0, validator=positive_number)  # tokens
    # "random": P(a regime is concentrated)
    p_concentrated: float = attrs.field(default=0.5, validator=in_range(0, 1))
    concentration: float = attrs.field(default=16.0, validator=positive_number)  # nats
    diffuse_std: float = attrs.field(default=1.0, validator=positive_number)  # nats
    num_anchors: int = attrs.field(default=4, validator=positive_int)  # per regime and head
    with_values: bool = attrs.field(default=True, validator=flag)
    model: str = "synthetic"

    def __attrs_post_init__(self) -> None:
        check(self, "head_dim", self.head_dim % 2 == 0 and self.head_dim >= 8, "even and >= 8")
        kv = self.num_kv_heads
        check(self, "num_q_heads", self.num_q_heads % kv == 0, f"a multiple of num_kv_heads ({kv})")

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.gen_len


def regime_schedule(spec: SyntheticSpec, gen: torch.Generator) -> list[tuple[int, int, str]]:
    """``[(start, end, kind), ...]`` covering ``[0, T)``; the prompt is its own first segment."""
    p0, T, half = spec.prompt_len, spec.num_tokens, spec.prompt_len + spec.gen_len // 2
    fixed = {
        "concentrated": [(p0, T, "concentrated")],
        "diffuse": [(p0, T, "diffuse")],
        "switch": [(p0, half, "concentrated"), (half, T, "diffuse")],
        "reverse_switch": [(p0, half, "diffuse"), (half, T, "concentrated")],
    }
    if spec.schedule in fixed:
        segments = [s for s in fixed[spec.schedule] if s[1] > s[0]]
    else:
        n = math.ceil(3 * spec.gen_len / spec.mean_regime_len) + 8  # enough with high prob
        while True:
            lengths = torch.empty(n).exponential_(generator=gen) * spec.mean_regime_len
            ends = (p0 + lengths.round().clamp(min=1).cumsum(0)).long().tolist()
            if ends[-1] >= T:
                break
            n *= 2
        kinds = (torch.rand(n, generator=gen) < spec.p_concentrated).tolist()
        starts = [p0] + ends[:-1]
        segments = [
            (s, min(e, T), "concentrated" if c else "diffuse")
            for s, e, c in zip(starts, ends, kinds, strict=True)
            if s < T
        ]
    return [(0, p0, "prompt"), *segments]


def _codebook_dims(d: int) -> torch.Tensor:
    """Dims of the lowest-frequency quarter of rotary pairs, laid out ``[x1 | x2]``."""
    n, half = max(1, d // 8), d // 2
    return torch.cat([torch.arange(half - n, half), torch.arange(d - n, d)])


def synthetic_trace(spec: SyntheticSpec, seed: int, request_id: str | None = None) -> Trace:
    """A seeded trace whose attention follows ``spec``'s concentrated/diffuse regime schedule.

    Returns fp32 tensors: queries ``[L, T, Hq, d]`` (pre-RoPE), keys and values
    ``[L, T, Hkv, d]`` (keys post-RoPE); the same ``(spec, seed)`` gives the same trace.
    """
    gen = torch.Generator().manual_seed(seed)
    L, T, Hkv, d = spec.num_layers, spec.num_tokens, spec.num_kv_heads, spec.head_dim
    segments = regime_schedule(spec, gen)
    is_conc = torch.tensor([kind == "concentrated" for _, _, kind in segments])
    lengths = torch.tensor([e - s for s, e, _ in segments])
    seg_of_token = torch.repeat_interleave(torch.arange(len(segments)), lengths)  # [T]
    cb = _codebook_dims(d)
    # Per (layer, KV head, segment): the codebook direction its concentrated queries follow.
    direction = torch.randint(len(cb), (L, Hkv, len(segments)), generator=gen)
    scale, q_norm = d**-0.5, math.sqrt(d)
    alpha = QUERY_ANCHOR_FRACTION * q_norm
    anchor = spec.concentration / (scale * alpha)  # anchor key magnitude A
    key_std = spec.diffuse_std / (scale * q_norm)  # bulk logits ~ N(0, diffuse_std^2)
    keys = torch.randn(L, T, Hkv, d, generator=gen) * key_std
    _place_anchors(keys, segments, is_conc, direction, cb, anchor, spec.num_anchors, gen)
    queries = _queries(spec, seg_of_token, is_conc, direction, cb, alpha, gen)
    values = torch.randn(L, T, Hkv, d, generator=gen) if spec.with_values else None
    rope = RopeConfig(head_dim=d, theta=float(spec.rope_theta))
    header = TraceHeader(
        request_id=request_id if request_id is not None else f"synthetic-{seed}",
        model=spec.model,
        num_layers=L,
        layer_ids=range(L),
        num_q_heads=spec.num_q_heads,
        num_kv_heads=Hkv,
        head_dim=d,
        rope=rope,
        softmax_scale=scale,
        prompt_len=spec.prompt_len,
        token_ids=torch.randint(VOCAB_SIZE, (T,), generator=gen).tolist(),
        has_values=spec.with_values,
        meta={
            "generator": "growpage.sim.synthetic",
            "seed": seed,
            "spec": attrs.asdict(spec),
            "regimes": [list(s) for s in segments],
        },
    )
    return Trace(header=header, queries=queries, keys=keys, values=values)


def _place_anchors(
    keys: torch.Tensor,
    segments: list[tuple[int, int, str]],
    is_conc: torch.Tensor,
    direction: torch.Tensor,
    cb: torch.Tensor,
    anchor: float,
    num_anchors: int,
    gen: torch.Generator,
) -> None:
    """Set ``keys[l, pos, h, cb[dir]] = A`` for the anchors of every concentrated segment.

    Anchors of a segment starting at ``s`` are drawn uniformly from the history ``[0, s)``.
    """
    L, _, Hkv, _ = keys.shape
    seg_ids = is_conc.nonzero().flatten()  # [K]
    if seg_ids.numel() == 0:
        return
    starts = torch.tensor([segments[i][0] for i in seg_ids.tolist()], dtype=torch.float64)
    u = torch.rand(L, Hkv, len(seg_ids), num_anchors, generator=gen, dtype=torch.float64)
    pos = (u * starts[None, None, :, None]).long()  # [L, Hkv, K, A]
    dims = cb[direction[:, :, seg_ids]].unsqueeze(-1).expand_as(pos)
    layer = torch.arange(L).view(L, 1, 1, 1).expand_as(pos)
    head = torch.arange(Hkv).view(1, Hkv, 1, 1).expand_as(pos)
    keys.index_put_(
        (layer.flatten(), pos.flatten(), head.flatten(), dims.flatten()), torch.tensor(anchor)
    )


def _queries(
    spec: SyntheticSpec,
    seg_of_token: torch.Tensor,
    is_conc: torch.Tensor,
    direction: torch.Tensor,
    cb: torch.Tensor,
    alpha: float,
    gen: torch.Generator,
) -> torch.Tensor:
    """Pre-RoPE queries ``[L, T, Hq, d]``: ``RoPE(-t)`` of each token's post-RoPE target."""
    L, T, Hq, d = spec.num_layers, spec.num_tokens, spec.num_q_heads, spec.head_dim
    group = Hq // spec.num_kv_heads
    conc = is_conc[seg_of_token]  # [T]
    # Non-codebook dims: a fixed per-head base direction plus per-token noise, drawn pre-RoPE
    # (keys are isotropic there, so any such query gives diffuse logits). The base direction is
    # what EMAs of diffuse queries keep. Its norm fills the query up to sqrt(d).
    noise_dims = d - len(cb)
    noise_norm = torch.where(conc, math.sqrt(d - alpha**2), math.sqrt(d)) / math.sqrt(noise_dims)
    base = torch.randn(L, 1, Hq, d, generator=gen) * math.sqrt(QUERY_BASE_SHARE)
    q = torch.randn(L, T, Hq, d, generator=gen).mul_(math.sqrt(1 - QUERY_BASE_SHARE)).add_(base)
    q *= noise_norm.view(1, T, 1, 1)
    # Codebook part: alpha * one-hot(direction) for concentrated tokens, rotated by -t.
    dir_t = direction[:, :, seg_of_token].repeat_interleave(group, dim=1)  # [L, Hq, T]
    target = torch.zeros(L, T, Hq, len(cb))
    target.scatter_(-1, dir_t.transpose(1, 2).unsqueeze(-1), alpha)
    target *= conc.view(1, T, 1, 1)
    inv = inv_frequencies(RopeConfig(head_dim=d, theta=float(spec.rope_theta)))
    angles = -torch.arange(T, dtype=torch.float32).unsqueeze(-1) * inv[cb[: len(cb) // 2]]
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # [T, 1, M]
    q[..., cb] = apply_rope(target, angles.cos(), angles.sin())
    return q


def write_synthetic_trace_set(
    directory: str | os.PathLike,
    spec: SyntheticSpec,
    output_lens: Sequence[int],
    seed: int = 0,
    dtype: torch.dtype = torch.float16,
) -> TraceSet:
    """Write one synthetic request per entry of ``output_lens`` (its ``gen_len``) as a set.

    Request ``i`` uses seed ``seed + i`` and request id ``synthetic-{i}``; it is tagged
    ``"synthetic"``.
    """
    traces = TraceSet(directory, create=True)
    for i, gen_len in enumerate(output_lens):
        trace = synthetic_trace(attrs.evolve(spec, gen_len=gen_len), seed + i, f"synthetic-{i}")
        traces.write(trace, tags=["synthetic"], dtype=dtype)
    return traces
