"""``BoundaryContext``'s demand signals against the paper's equations, written out with loops.

Independent of the package's own helpers (``group_attention``, ``rope_at``, ``coverage_demand``):
a hand-written RoPE, one softmax per query head, a Python top-p count, all in float64 from the
same float32 inputs the view holds. Per (layer, KV head) and summary S / L:

* Eq. 12: the summary scaled to the current query's RMS over d, then rotated to position t;
* candidates C_t: the N - b oldest slots (the most recent page left out), logits q . k / sqrt(d);
* GQA: a KV head's distribution is the mean of its query heads' softmaxes;
* Eq. 7-8: r = K_p / |C_t| with K_p the fewest candidates holding p of the mass, averaged over
  layers and KV heads; Delta_t = r^S - r^L;
* Eq. 9: scores max(a^S, a^L) over the N - R slots outside the protected recent window.
"""

from __future__ import annotations

import math

import pytest
import torch

from growpage.core.boundary_context import BoundaryContext
from growpage.core.config import GrowPageConfig
from growpage.core.kv_view import DenseKVView
from growpage.core.rope import RopeConfig

THETA = 10000.0


def rotate(x: torch.Tensor, position: int) -> torch.Tensor:
    """RoPE of ``x [..., d]`` at ``position``: dimension i pairs with i + d/2."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        angle = position * THETA ** (-2 * i / d)
        c, s = math.cos(angle), math.sin(angle)
        out[..., i] = x[..., i] * c - x[..., i + d // 2] * s
        out[..., i + d // 2] = x[..., i + d // 2] * c + x[..., i] * s
    return out


def top_p_count(weights: torch.Tensor, p: float) -> int:
    total = 0.0
    for k, w in enumerate(sorted(weights.tolist(), reverse=True), 1):
        total += w
        if total >= p:
            return k
    return len(weights)


def float32_values(*shape: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """float64 values that a float32 tensor holds exactly (the view stores float32)."""
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).float().double()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    ("num_kv", "group", "scale"), [(2, 2, 2.0), (2, 1, 2.0), (1, 4, 2.0), (2, 2, 0.3), (2, 2, 6.0)]
)
def test_delta_and_scores_follow_the_paper(
    seed: int, num_kv: int, group: int, scale: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    layers, d, b, pages, recent, gap, p = 2, 8, 8, 4, 3, 5, 0.99
    num_q, n = num_kv * group, pages * b
    t = n + gap  # the position of the token that needs a slot; slot i holds position i + gap
    raw = float32_values(layers, num_kv, n, d, g=g)
    keys = torch.stack([rotate(raw[:, :, i], i + gap) for i in range(n)], dim=2)
    keys = keys.float().double()  # what the view holds
    short = float32_values(layers, num_q, d, g=g, scale=scale)
    long = float32_values(layers, num_q, d, g=g, scale=scale)
    current = float32_values(layers, num_q, d, g=g, scale=scale)

    view = DenseKVView(layers, num_q, num_kv, d, RopeConfig(head_dim=d, theta=THETA), n)
    view.extend(keys.float(), torch.arange(n) + gap)
    view.set_queries(torch.stack([short, long], dim=1).float(), current.float())
    ctx = BoundaryContext(
        "r", n, t, pages, 3, GrowPageConfig(page_size=b, recent_window=recent), view
    )

    ratio, attention = {}, {}
    for name, summary in (("short", short), ("long", long)):
        r = torch.zeros(layers, num_kv, dtype=torch.float64)
        a = torch.zeros(layers, num_kv, n - recent, dtype=torch.float64)
        for layer in range(layers):
            for h in range(num_kv):
                estimate, select = 0.0, 0.0
                for qh in range(h * group, (h + 1) * group):
                    rms = float(current[layer, qh].pow(2).mean().sqrt())
                    q = summary[layer, qh] * rms / float(summary[layer, qh].pow(2).mean().sqrt())
                    q = rotate(q, t)
                    logits = torch.tensor(
                        [float(q @ keys[layer, h, i]) / math.sqrt(d) for i in range(n)],
                        dtype=torch.float64,
                    )
                    estimate = estimate + logits[: n - b].softmax(0) / group
                    select = select + logits[: n - recent].softmax(0) / group
                r[layer, h] = top_p_count(estimate, p) / (n - b)
                a[layer, h] = select
        ratio[name], attention[name] = r, a

    for name in ("short", "long"):  # float32 ratios: a count off by one is 1/24 off
        torch.testing.assert_close(
            ctx.working_set_ratio(name, p).double(), ratio[name], atol=1e-6, rtol=0
        )
    want = float(ratio["short"].mean() - ratio["long"].mean())
    assert ctx.delta(p) == pytest.approx(want, abs=1e-6)
    torch.testing.assert_close(
        ctx.scores().double(),
        torch.maximum(attention["short"], attention["long"]),
        atol=1e-5,
        rtol=1e-4,
    )
