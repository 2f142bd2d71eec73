"""The decode step's host-side fast paths compute what the plain formulas compute.

Each fast path (issue 30) is checked against the straightforward computation it replaced: the
query-summary blend against ``where(first, q, old * beta + q * (1 - beta))`` bit for bit, the
packed step inputs against one tensor per field, the single-token decode cache against the
decoder, the one-sync log-probs against ``log_softmax``; and ``benchmarks/host_cost.py``'s
measurement on a tiny point.
"""

from __future__ import annotations

import pytest
import torch
from benchmark_scripts import load_benchmark

from growpage.engine.loop.detokenizer import IncrementalDetokenizer
from growpage.engine.loop.model_runner import DecodeInputs, DecodeRows, slot_range
from growpage.engine.loop.query_state import QueryStatePool
from growpage.engine.loop.sampler import Sampler

L, M, HQ, D = 3, 9, 4, 8


def byte_decode(ids):
    """Token ``i`` is byte ``i % 256`` (a byte-level BPE split to single bytes)."""
    return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


def blended(pool: QueryStatePool, slots: list[int], q: torch.Tensor, first: torch.Tensor):
    """The EMA update of Eq. 6 written plainly, out of place: (summaries, current) after it."""
    betas = torch.tensor([pool.beta_short, pool.beta_long]).view(1, 1, 2, 1, 1)
    index = torch.tensor(slots)
    old = pool.summaries[:, index]
    new = old * betas + q.unsqueeze(2) * (1 - betas)
    new = torch.where(first.view(1, -1, 1, 1, 1), q.unsqueeze(2).expand_as(new), new)
    summaries, current = pool.summaries.clone(), pool.current.clone()
    summaries[:, index] = new
    current[:, index] = q
    return summaries, current


@pytest.mark.parametrize("layout", ["gathered", "consecutive", "stacked in place"])
def test_query_state_update_is_the_plain_blend_bit_for_bit(layout):
    gen = torch.Generator().manual_seed(0)
    pool = QueryStatePool(L, M, HQ, D, 0.9, 0.999)
    for step in range(8):
        batch = int(torch.randint(1, M + 1, (1,), generator=gen))
        if layout == "gathered":
            slots = torch.randperm(M, generator=gen)[:batch].tolist()
        else:
            start = int(torch.randint(0, M - batch + 1, (1,), generator=gen))
            slots = list(range(start, start + batch))
        first = torch.rand(batch, generator=gen) < (0.5 if step < 2 else 0.2)
        q = torch.randn(L, batch, HQ, D, generator=gen) * 3
        want = blended(pool, slots, q, first)
        where: torch.Tensor | slice | None = slot_range(slots)
        if layout == "gathered":
            where = torch.tensor(slots)
        assert where is not None
        if layout == "stacked in place":  # the runner stacks the queries into current
            q = torch.stack(list(q), out=pool.current[:, where])
        any_first = [None, bool(first.any())][step % 2]
        pool.update(where, q, first, True, any_first)
        assert torch.equal(pool.summaries, want[0])
        assert torch.equal(pool.current, want[1])


def test_query_state_update_without_summaries_stores_only_the_queries():
    pool = QueryStatePool(L, M, HQ, D, 0.9, 0.999)
    pool.summaries.normal_()
    before = pool.summaries.clone()
    q = torch.randn(L, 3, HQ, D)
    for slots in (torch.tensor([5, 1, 7]), slice(2, 5)):
        pool.update(slots, q, torch.zeros(3, dtype=torch.bool), summaries=False)
        assert torch.equal(pool.current[:, slots], q)
    assert torch.equal(pool.summaries, before)


def test_slot_range():
    assert slot_range([3, 4, 5]) == slice(3, 6)
    assert slot_range([0]) == slice(0, 1)
    assert slot_range([3, 5, 4]) is None
    assert slot_range([3, 3, 5]) is None  # spans the range but is not it
    assert slot_range([]) is None


@pytest.mark.parametrize("batch", [1, 2, 3, 7])
def test_packed_decode_inputs_are_the_rows_one_tensor_each(batch):
    rows = DecodeRows(
        ids=[100 + i for i in range(batch)],
        positions=[200 + i for i in range(batch)],
        slots=[300 + i for i in range(batch)],
        lens=[400 + i for i in range(batch)],
        query_slots=[batch - 1 - i for i in range(batch)],
        first=[i % 3 == 0 for i in range(batch)],
    )
    tables = [list(range(10 * i, 10 * i + 1 + i % 3)) for i in range(batch)]
    flat, width = rows.packed(tables)
    got = DecodeInputs.of(torch.tensor(flat), batch, width)
    assert width == max(len(t) for t in tables)
    for name in ("ids", "positions", "slots", "lens", "query_slots", "first"):
        tensor = getattr(got, name)
        assert torch.equal(tensor, torch.tensor(getattr(rows, name), dtype=torch.long)), name
    padded = [t + [-1] * (width - len(t)) for t in tables]
    assert torch.equal(got.block_tables, torch.tensor(padded))
    for tensor in (*(getattr(got, n) for n in ("ids", "slots", "first")), got.block_tables):
        assert tensor.is_contiguous() and tensor.data_ptr() % 16 == 0


class CountingDecode:
    def __init__(self):
        self.calls: list[list[int]] = []

    def __call__(self, ids):
        self.calls.append(list(ids))
        return byte_decode(ids)


def test_the_detokenizer_with_shared_single_texts_gives_the_full_decode():
    ids = list("naïve ∑ 😀 text, more text ✓".encode()) * 4
    inner = CountingDecode()
    single: dict[int, str] = {}
    det = IncrementalDetokenizer(inner, single)
    other = IncrementalDetokenizer(inner, single)  # a second request sharing the texts
    plain = IncrementalDetokenizer(byte_decode)
    out: list[int] = []
    for t in ids:
        out.append(t)
        assert det.update(out) == plain.update(out)
        assert det.text + det.pending == byte_decode(out)
    num_single = sum(len(c) == 1 for c in inner.calls)
    assert num_single <= len(set(ids)) and single
    for n in range(1, len(ids) + 1):  # every single token is known: only its first window
        other.update(ids[:n])
    assert other.text + other.pending == byte_decode(ids)
    assert sum(len(c) == 1 for c in inner.calls) == num_single + 1
    with pytest.raises(ValueError, match="extend the ids"):
        det.update(out[:-1] + [out[-1] + 1])


def test_logprobs_in_one_sync_are_log_softmax_and_ranks():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 40, generator=gen)
    logits[2, 7] = logits[2].max() + 1  # a greedy pick: rank 0
    tokens = [0, 39, 7, 12, 12]
    values, ranks = Sampler.logprobs(logits, tokens)
    logp = torch.log_softmax(logits, dim=-1)
    assert values == [logp[i, t].item() for i, t in enumerate(tokens)]
    assert ranks == [int((logits[i] > logits[i, t]).sum()) for i, t in enumerate(tokens)]
    assert ranks[2] == 0 and all(isinstance(r, int) for r in ranks)


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("host_cost")


def test_host_cost_point_decodes_the_batch_and_splits_its_time(bench):
    from growpage.engine.loading.tokenizer import load_tokenizer

    args = bench.parse_args(["--max-tokens", "40", "--page-size", "16", "--layers", "2"])
    parts = {"model": bench.narrow_model(8, 512, 2), "tokenizer": load_tokenizer()}
    full = bench.measure_point("torch", "fullkv", 3, args, parts)
    assert full["steps"] == 39  # every token after the prefill's first: one step for all
    rows = [bench.measure_point("torch", "growpage", 3, args, parts) for _ in range(2)]
    row = rows[0]
    assert row["steps"] >= 39  # (a tight pool: a preempted request decodes on its own)
    assert row["fingerprint"] and row["fingerprint"] == rows[1]["fingerprint"]
    assert row["events"]["boundaries"] > 0  # 40 tokens past 45-75 cross pages of 16
    phases = row["phases_ms"]
    assert sum(phases.values()) == pytest.approx(row["phases_total_ms"], rel=1e-6)
    assert phases["detokenize"] > 0 and phases["boundary"] > 0
    assert 0 < row["forward_ms"] < row["ms_per_step"]


def test_host_cost_report_compares_medians_and_flags_differences(bench):
    def row(ms, fingerprint, backend="torch"):
        return {
            "backend": backend,
            "policy": "fullkv",
            "batch": 64,
            "steps": 10,
            "ms_per_step": ms,
            "wall_ms_per_step": ms + 1,
            "forward_ms": 0.5,
            "phases_total_ms": ms,
            "phases_ms": dict.fromkeys(bench.PHASES, ms / len(bench.PHASES)),
            "events": {},
            "fingerprint": fingerprint,
        }

    runs = {
        "before": [[row(4.0, "a")], [row(6.0, "a")], [row(5.0, "a")]],
        "after": [[row(2.5, "a")], [row(1.5, "a")], [row(9.0, "a")]],
    }
    (point,) = bench.summarize(runs)["points"]
    assert point["before"]["host_ms"] == 4.5 and point["after"]["host_ms"] == 2.0
    assert point["ratio"] == pytest.approx(2.0 / 4.5) and point["identical"] is True
    runs["after"][1] = [row(1.5, "b")]
    assert bench.summarize(runs)["points"][0]["identical"] is False
    for reps in runs.values():
        for rep in reps:
            rep[0]["backend"] = "triton"
    assert bench.summarize(runs)["points"][0]["identical"] is None  # stubbed kernels


def test_whole_step_ratios_pair_the_points_of_one_worker_run(bench):
    """growpage against fullkv, and 64 against 256, are divided within each worker run: a run
    that was slow throughout cancels out, where a ratio of medians would mix runs."""

    def point(policy, batch, before, after):
        return {
            "backend": "torch",
            "policy": policy,
            "batch": batch,
            "before": {"ms_per_step": sorted(before)[1], "runs_ms": before, "steps": 9},
            "after": {"ms_per_step": sorted(after)[1], "runs_ms": after, "steps": 9},
        }

    points = [
        point("fullkv", 64, [4.0, 8.0, 5.0], [4.0, 8.0, 4.0]),
        point("growpage", 64, [6.0, 10.0, 7.5], [5.0, 9.6, 4.4]),
        point("growpage", 256, [18.0, 30.0, 22.5], [15.0, 25.0, 13.2]),
    ]
    lines = bench._whole_steps(points)
    assert "- after torch growpage / fullkv at 64: 1.20x (runs 1.10-1.25)" in lines
    assert "- before torch growpage / fullkv at 64: 1.50x (runs 1.25-1.50)" in lines
    assert "- after torch growpage from 64 to 256: 3.00x (runs 2.60-3.00)" in lines
    assert bench.RATIOS_NOTE in lines
    assert bench.run_ratios([3.0], [2.0]) == "1.50x"


def test_a_before_tree_the_worker_cannot_import_is_refused_by_name(bench, tmp_path):
    from script_args import ROOT

    bench.check_tree("HEAD", ROOT)  # this checkout has every module the worker imports
    old = tmp_path / "tree"  # the layout before growpage/engine's sub-packages
    for module in ("growpage/engine/loader.py", "growpage/engine/llm.py", "growpage/core/rope.py"):
        (old / module).parent.mkdir(parents=True, exist_ok=True)
        (old / module).write_text("")
    with pytest.raises(SystemExit, match=r"--before OLD: its tree lacks .*loading/loader\.py"):
        bench.check_tree("OLD", old)
    with pytest.raises(SystemExit, match=r"--before no-such-ref: git archive cannot export it"):
        bench.export_tree("no-such-ref", tmp_path / "missing")


def test_a_worker_that_cannot_import_a_module_of_the_before_tree_names_it(bench, tmp_path):
    """A module outside ``WORKER_MODULES`` that the before tree lacks: the worker's import
    error becomes one line naming the module and the ref, not a traceback to read."""
    tree = tmp_path / "path" / "growpage"
    tree.mkdir(parents=True)
    (tree / "__init__.py").write_text("")  # a package without growpage.errors
    args = bench.parse_args(["--tiny", "--before", "OLD", "--batches", "64"])
    with pytest.raises(SystemExit, match=r"--before OLD: the worker imports growpage\.errors, "):
        bench.run_worker(args, tmp_path / "path", tmp_path / "out.json")
