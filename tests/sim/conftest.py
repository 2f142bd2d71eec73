"""Shared helpers for the trace-format and synthetic-trace tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from growpage.core.rope import RopeConfig, rope_at
from growpage.core.traces import Trace, TraceHeader


def small_trace(
    num_tokens: int = 12,
    prompt_len: int = 5,
    has_values: bool = True,
    request_id: str = "req-0",
    seed: int = 0,
) -> Trace:
    """A tiny valid trace: 2 recorded layers (ids 1 and 3 of 4), 4 query / 2 KV heads, d = 8."""
    g = torch.Generator().manual_seed(seed)
    L, Hq, Hkv, d = 2, 4, 2, 8
    header = TraceHeader(
        request_id=request_id,
        model="tiny",
        num_layers=4,
        layer_ids=[1, 3],
        num_q_heads=Hq,
        num_kv_heads=Hkv,
        head_dim=d,
        rope=RopeConfig(head_dim=d),
        softmax_scale=d**-0.5,
        prompt_len=prompt_len,
        token_ids=list(range(100, 100 + num_tokens)),
        has_values=has_values,
        meta={"note": "test", "nested": [1, 2.5, None]},
    )
    v = torch.randn(L, num_tokens, Hkv, d, generator=g) if has_values else None
    return Trace(
        header=header,
        queries=torch.randn(L, num_tokens, Hq, d, generator=g),
        keys=torch.randn(L, num_tokens, Hkv, d, generator=g),
        values=v,
    )


def working_set_ratio(trace: Trace, t: int, p: float = 0.99) -> torch.Tensor:
    """Top-p working-set ratio ``[L, Hkv]`` of the real attention of the query at ``t``.

    The query (rotated to position ``t``) attends to keys ``0..t-1``; a KV head's distribution is
    the mean of its query heads' softmax distributions (GQA).
    """
    h = trace.header
    group = h.num_q_heads // h.num_kv_heads
    q = rope_at(h.rope, trace.queries[:, t].double(), t)  # [L, Hq, d]
    k = trace.keys[:, :t].double().repeat_interleave(group, dim=2)  # [L, t, Hq, d]
    attn = (torch.einsum("lhd,lthd->lht", q, k) * h.softmax_scale).softmax(-1)
    attn = attn.view(q.shape[0], h.num_kv_heads, group, t).mean(2)  # [L, Hkv, t]
    cum = attn.sort(-1, descending=True).values.cumsum(-1)
    return ((cum < p).sum(-1) + 1).double() / t


@pytest.fixture(scope="session")
def make_trace() -> Callable[..., Trace]:
    return small_trace


@pytest.fixture(scope="session")
def ws_ratio() -> Callable[..., torch.Tensor]:
    return working_set_ratio


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Small tensor ops run several times faster single-threaded on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
