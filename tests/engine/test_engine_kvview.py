"""The live-cache KV view: compaction against a dense reference, positions, query-state pool."""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import tiny_pair

from growpage.core.config import GrowPageConfig
from growpage.core.demand import update_query_summaries
from growpage.engine.config import EngineConfig
from growpage.engine.loop.kv_manager import KVCacheManager
from growpage.engine.loop.model_runner import ModelRunner
from growpage.engine.loop.paged_kv_view import EngineKVView, direct_copy_safe, page_slots
from growpage.engine.loop.query_state import QueryStatePool
from growpage.engine.loop.scheduler import SchedulerOutput
from growpage.engine.loop.sequence import Sequence
from growpage.engine.modeling.attention import TorchAttentionBackend
from growpage.engine.modeling.step_context import decode_context
from growpage.engine.sampling_params import SamplingParams
from growpage.policies import FullKVPolicy

PAGE = 4


@pytest.fixture(scope="module")
def model():
    return tiny_pair("qwen3")[0]


def prefilled(model, prompt_len: int, num_pages: int = 32):
    """A KV manager with one sequence whose prompt has been prefilled (shuffled pages)."""
    config = EngineConfig(
        growpage=GrowPageConfig(page_size=PAGE, recent_window=2),
        kv_pages=num_pages,
        enable_prefix_caching=False,
    )
    kv = KVCacheManager(model.config, config, FullKVPolicy())
    kv.pool.allocate(num_pages // 2)  # the request's pages come from the middle of the cache
    seq = Sequence(0, "r", list(range(3, 3 + prompt_len)), SamplingParams())
    kv.admit(seq)
    seq.state.num_tokens = seq.state.position = prompt_len
    ModelRunner(model, kv).run(SchedulerOutput(True, (seq,), (prompt_len,)))
    return kv, seq


def naive_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """``q [Hq, d]`` over ``k, v [Hkv, N, d]`` restricted per KV head to slots ``keep [Hkv, K]``."""
    hq, d = q.shape
    group = hq // k.shape[0]
    out = torch.empty(hq, d, dtype=torch.float64)
    for h in range(hq):
        kv_head = h // group
        kh, vh = k[kv_head, keep[kv_head]].double(), v[kv_head, keep[kv_head]].double()
        out[h] = torch.softmax(kh @ q[h].double() / math.sqrt(d), 0) @ vh
    return out.float()


def random_keep(num_layers: int, num_kv: int, n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(n, generator=gen)[:k].sort().values for _ in range(num_layers * num_kv)]
    return torch.stack(rows).reshape(num_layers, num_kv, k)


@pytest.mark.parametrize("copy_on_write", [False, True])
def test_compacted_decode_equals_attention_over_selected_positions(model, copy_on_write):
    kv, seq = prefilled(model, prompt_len=6 * PAGE)
    c = model.config
    view = EngineKVView(seq, kv.cache, kv.query_pool, c.rope, c.num_q_heads)
    n = seq.state.num_tokens
    slots = page_slots(seq.state.block_table, n, PAGE)
    full_k = kv.cache[0].flatten(1, 2)[:, slots].permute(0, 2, 1, 3).clone()  # [L, Hkv, N, d]
    full_v = kv.cache[1].flatten(1, 2)[:, slots].permute(0, 2, 1, 3).clone()
    assert torch.equal(view.keys(), full_k)
    keep = random_keep(c.num_layers, c.num_kv_heads, n, 5 * PAGE - 3, seed=1)
    src = list(seq.state.block_table)
    dst = list(src)
    if copy_on_write:  # pages 0 and 2 replaced by fresh ones; the originals must stay intact
        dst[0], dst[2] = kv.pool.allocate(2)
        before = kv.cache[:, :, [src[0], src[2]]].clone()
    view.compact(keep, src, dst)
    if copy_on_write:
        assert torch.equal(kv.cache[:, :, [src[0], src[2]]], before)
    seq.state.block_table, seq.state.num_tokens = dst, keep.shape[-1]
    assert torch.equal(view.positions(), keep)  # slot i held position i before
    q = torch.randn(
        c.num_layers, 1, c.num_q_heads, c.head_dim, generator=torch.Generator().manual_seed(2)
    )
    ctx = decode_context(torch.tensor([-1]), torch.tensor([dst]), torch.tensor([keep.shape[-1]]))
    for layer in range(c.num_layers):
        got = TorchAttentionBackend().decode(q[layer], kv.cache[:, layer], ctx, c.head_dim**-0.5)
        expected = naive_decode(q[layer, 0], full_k[layer], full_v[layer], keep[layer])
        torch.testing.assert_close(got[0], expected, atol=1e-5, rtol=1e-5)


def test_positions_follow_compactions_and_appends(model):
    kv, seq = prefilled(model, prompt_len=3 * PAGE)
    c = model.config
    view = EngineKVView(seq, kv.cache, kv.query_pool, c.rope, c.num_q_heads)
    keep = random_keep(c.num_layers, c.num_kv_heads, 3 * PAGE, 2 * PAGE, seed=3)
    view.compact(keep, seq.state.block_table, seq.state.block_table)
    seq.state.num_tokens = 2 * PAGE
    for _ in range(3):  # three decode tokens at positions 12, 13, 14
        kv.append_slot(seq)
    pos = view.positions()
    assert pos.shape == (c.num_layers, c.num_kv_heads, 2 * PAGE + 3)
    assert torch.equal(pos[..., : 2 * PAGE], keep)
    assert pos[..., 2 * PAGE :].eq(torch.tensor([12, 13, 14])).all()
    keep2 = random_keep(c.num_layers, c.num_kv_heads, 2 * PAGE + 3, PAGE + 3, seed=4)
    seq.state.num_tokens = 2 * PAGE + 3
    view.compact(keep2, seq.state.block_table, seq.state.block_table)
    seq.state.num_tokens = PAGE + 3
    assert torch.equal(view.positions(), torch.gather(pos, 2, keep2))


def test_query_state_pool_matches_core_ema():
    pool = QueryStatePool(
        num_layers=2, max_slots=4, num_q_heads=3, head_dim=8, beta_short=0.9, beta_long=0.999
    )
    a, b = pool.bind(), pool.bind()
    reference = torch.zeros(2, 2, 2, 3, 8)  # [L, request, 2, Hq, d]
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        q = torch.randn(2, 2, 3, 8, generator=gen)  # [L, B, Hq, d]
        first = torch.tensor([step == 0, step in (0, 3)])  # slot b is re-initialized at step 3
        pool.update(torch.tensor([a, b]), q, first)
        for i in range(2):
            update_query_summaries(reference[:, i], q[:, i], 0.9, 0.999, bool(first[i]))
    for i, slot in enumerate((a, b)):
        state = pool.read(slot)
        torch.testing.assert_close(state.short, reference[:, i, 0])
        torch.testing.assert_close(state.long, reference[:, i, 1])
        assert torch.equal(state.current, q[:, i])
    pool.release(a)
    assert pool.num_free_slots == 3 and pool.bind() == a


def test_a_zero_start_pool_holds_the_bias_corrected_average_up_to_scale():
    """summary_start="average": each summary is (1 - beta) sum_i beta^(n-i) q_i, the
    bias-corrected average times (1 - beta^n), whatever the slot held before."""
    pool = QueryStatePool(2, 2, 3, 8, beta_short=0.9, beta_long=0.99, zero_start=True)
    slot = pool.bind()
    pool.summaries[:, slot] = float("nan")  # a previous owner's leftovers: cleared on bind
    pool.release(slot)
    slot = pool.bind()
    gen = torch.Generator().manual_seed(1)
    queries = [torch.randn(2, 1, 3, 8, generator=gen) for _ in range(6)]
    for n, q in enumerate(queries):
        assert not pool.is_first(n)
        pool.update(torch.tensor([slot]), q, torch.tensor([pool.is_first(n)]))
    for index, beta in ((0, 0.9), (1, 0.99)):
        n = len(queries)
        average = sum(beta ** (n - 1 - i) * q[:, 0] for i, q in enumerate(queries))
        average = average * (1 - beta) / (1 - beta**n)
        got = pool.summaries[:, slot, index]
        torch.testing.assert_close(got / (1 - beta**n), average, rtol=1e-5, atol=1e-6)
    assert QueryStatePool(1, 1, 1, 2, 0.9, 0.99).is_first(0)  # the paper's start


@pytest.mark.parametrize("tables", ["same", "copy_on_write", "shrink", "swapped"])
def test_kernel_path_matches_torch_path(model, tables):
    """Demand estimation and compaction through the Triton kernels (interpreter on CPU, compiled
    on CUDA) give what the torch path gives, on the same live cache."""
    from growpage.core.boundary_context import BoundaryContext

    kv, seq = prefilled(model, prompt_len=5 * PAGE + 2)
    c = model.config
    q = torch.randn(
        c.num_layers, 1, c.num_q_heads, c.head_dim, generator=torch.Generator().manual_seed(7)
    )
    slot = kv.query_pool.bind()
    seq.query_slot = slot
    kv.query_pool.update(torch.tensor([slot]), q, torch.tensor([True]))
    kv.query_pool.update(torch.tensor([slot]), q.flip(-1), torch.tensor([False]))
    seq.num_decode_steps = 2
    gp = GrowPageConfig(page_size=PAGE, recent_window=2)
    views = {
        flag: EngineKVView(seq, kv.cache, kv.query_pool, c.rope, c.num_q_heads, use_kernels=flag)
        for flag in (False, True)
    }
    st = seq.state
    ctxs = {
        flag: BoundaryContext(
            st.request_id, st.num_tokens, st.position, len(st.block_table), 0, gp, views[flag]
        )
        for flag in views
    }
    # calibrated, rotated summaries: one Triton launch vs the torch maths
    torch.testing.assert_close(ctxs[True]._queries, ctxs[False]._queries, atol=2e-5, rtol=1e-5)
    for name in ("short", "long"):
        torch.testing.assert_close(
            ctxs[True].attention(name), ctxs[False].attention(name), atol=1e-6, rtol=1e-5
        )
    assert ctxs[True].delta() == pytest.approx(ctxs[False].delta(), abs=1e-6)
    assert "_logits" not in ctxs[True].__dict__  # the kernel path never gathers the keys
    n = seq.state.num_tokens
    keep = random_keep(c.num_layers, c.num_kv_heads, n, 4 * PAGE, seed=5)
    src = list(seq.state.block_table)
    dst = list(src)
    if tables == "copy_on_write":
        dst[1], dst[3] = kv.pool.allocate(2)
    elif tables == "shrink":  # one page fewer: the destination table is -1 padded on the device
        dst.pop(2)
    elif tables == "swapped":  # pages at other indices: only the staged copy is safe
        dst[0], dst[4] = dst[4], dst[0]
    state = (seq.kept_positions, seq.tail_start)
    before = kv.cache.clone()
    views[False].compact(keep, src, dst)
    want, want_positions = kv.cache.clone(), seq.kept_positions
    kv.cache.copy_(before)
    seq.kept_positions, seq.tail_start = state
    views[True].compact(keep, src, dst)
    assert torch.equal(kv.cache, want) and torch.equal(seq.kept_positions, want_positions)


@pytest.mark.parametrize(
    ("src", "dst", "safe"),
    [
        ([7, 2, 9], [7, 2, 9], True),
        ([7, 2, 9], [7, 5, 9], True),  # a fresh page: nothing moves across pages
        ([7, 2, 9], [7, 9], False),  # 9 moves from index 2 to 1
        ([7, 2, 9], [7, 2], True),  # the last page dropped
        ([7, 2, 9], [2, 7, 9], False),
        ([], [], True),
    ],
)
def test_direct_copy_safe_matches_the_kernel_check(src, dst, safe):
    from growpage.kernels import is_direct_safe

    assert direct_copy_safe(src, dst) is safe
    if src:
        width = max(len(src), len(dst))
        pad = lambda t: torch.tensor([t + [-1] * (width - len(t))], dtype=torch.int32)  # noqa: E731
        assert bool(is_direct_safe(pad(src), pad(dst))[0]) is safe
