"""``growpage demo``: the policies side by side on one regime-switching decode stream.

A small stand-in for a model: keys are random, and the query alternates between a concentrated
regime (aimed at a few anchor tokens) and a diffuse one. Each policy runs through the shared
``CapacityController``; the table shows what it spent (average KV budget, pages) and what it kept
(attention mass of each new query that falls on the resident tokens, over all past tokens).
"""

from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from growpage.core.capacity import CapacityController
from growpage.core.config import GrowPageConfig
from growpage.core.demand import update_query_summaries
from growpage.core.kvview import DenseKVView
from growpage.core.pages import PagePool
from growpage.core.request import RequestState
from growpage.core.rope import RopeConfig, rope_at
from growpage.policies import resolve_policy

LAYERS, KV_HEADS, GROUP, HEAD_DIM = 2, 2, 2, 16
REGIME_TOKENS = 300  # tokens per regime


def _stream(steps: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-RoPE keys ``[T, L, Hkv, d]`` and pre-RoPE queries ``[T, L, Hq, d]``."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(steps, LAYERS, KV_HEADS, HEAD_DIM, generator=g)
    queries = torch.randn(steps, LAYERS, KV_HEADS * GROUP, HEAD_DIM, generator=g) * 0.3
    rope = RopeConfig(head_dim=HEAD_DIM)
    for t in range(steps):
        if (t // REGIME_TOKENS) % 2 == 0 and t > 8:  # concentrated: aim at an anchor token
            anchor = int(torch.randint(0, 8, (1,), generator=g))
            target = keys[anchor].repeat_interleave(GROUP, dim=1) * 3.0
            queries[t] = rope_at(rope, target, -t)
    return keys, queries


def run_policy(name: str, steps: int, page_size: int, seed: int) -> dict:
    config = GrowPageConfig(page_size=page_size, recent_window=page_size // 8)
    pool = PagePool(steps // page_size + 4, page_size)
    kwargs = {"budget_tokens": 4 * page_size} if name == "fixed" else {}
    ctrl = CapacityController(resolve_policy(name, **kwargs), pool, config)
    rope = RopeConfig(head_dim=HEAD_DIM)
    keys, queries = _stream(steps, seed)
    view = DenseKVView(LAYERS, KV_HEADS * GROUP, KV_HEADS, HEAD_DIM, rope, capacity=steps)
    state = RequestState(name, pool.allocate(1))
    summaries = torch.zeros(LAYERS, 2, KV_HEADS * GROUP, HEAD_DIM)
    budget, mass = 0.0, 0.0
    for t in range(steps):
        update_query_summaries(summaries, queries[t], config.beta_short, config.beta_long, t == 0)
        view.set_queries(summaries.clone(), queries[t])
        if ctrl.needs_decision(state):
            ctrl.on_boundary(state, view)
        view.append(keys[t], t)
        state.num_tokens += 1
        state.position += 1
        budget += state.num_pages * page_size
        mass += _resident_mass(view, keys[: t + 1], rope_at(rope, queries[t], t))
    return {"policy": name, "avg_budget": budget / steps, "final_pages": state.num_pages,
            "kept_mass": mass / steps, **ctrl.events.as_dict()}


def _resident_mass(view: DenseKVView, all_keys: torch.Tensor, q: torch.Tensor) -> float:
    q = q.reshape(LAYERS, KV_HEADS, GROUP, HEAD_DIM)
    attn = torch.einsum("lhgd,tlhd->lhgt", q, all_keys).mul(HEAD_DIM ** -0.5).softmax(-1)
    attn = attn.mean(2)  # [L, Hkv, T]
    kept = torch.gather(attn, 2, view.positions())
    return float(kept.sum(-1).mean())


def run(args: argparse.Namespace) -> int:
    rows = [run_policy(name, args.steps, args.page_size, args.seed)
            for name in tqdm(args.policies, desc="policies", unit="policy")]
    cols = ["policy", "avg_budget", "final_pages", "kept_mass", "grow", "compress", "fallback"]
    print(" | ".join(f"{c:>11}" for c in cols))
    for row in rows:
        print(" | ".join(f"{row[c]:>11.3f}" if isinstance(row[c], float) else f"{row[c]:>11}"
                         for c in cols))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="compare policies on a regime-switching stream")
    p.add_argument("--policies", nargs="+", default=["growpage", "fixed", "fullkv", "inverse"])
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)
