"""Trace recording: every finished request becomes a trace whose rows equal a dense forward."""

from __future__ import annotations

import pytest
import torch
from llm_helpers import GREEDY, prompt, tiny_llm, tiny_model

from growpage.core.trace_set import TraceSet
from growpage.engine.modeling.step_context import StepCapture, prefill_context, use_context

PROMPTS = [prompt(7, 41), prompt(13, 42), prompt(4, 43)]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@torch.inference_mode()
def dense_capture(model, ids: list[int]) -> StepCapture:
    capture = StepCapture(record_kv=True)
    with use_context(prefill_context([len(ids)], capture=capture)):
        model(torch.tensor(ids), torch.arange(len(ids)))
    return capture


@pytest.mark.parametrize("kv_pages", [256, 22])  # 22: requests are preempted and recomputed
def test_recorded_traces_equal_a_dense_forward(model, tmp_path, kv_pages):
    llm = tiny_llm(model, record_traces=tmp_path / "set", record_layers=[1], kv_pages=kv_pages)
    assert not llm.config.enable_prefix_caching
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert (llm.last_stats.num_preemptions > 0) == (kv_pages == 22)
    traces = TraceSet(tmp_path / "set")
    assert len(traces) == len(PROMPTS)
    for out in outs:
        trace = traces.read(out.request_id)
        h = trace.header
        assert list(h.token_ids) == out.prompt_token_ids + out.token_ids[:-1]
        assert h.prompt_len == len(out.prompt_token_ids) and h.layer_ids == (1,)
        assert h.meta["last_token_id"] == out.token_ids[-1] and h.meta["policy"] == "fullkv"
        ref = dense_capture(model, list(h.token_ids))
        for name, got, expected in (
            ("q", trace.queries[0], ref.queries[1]),
            ("k", trace.keys[0], ref.keys[1]),
            ("v", trace.values[0], ref.values[1]),
        ):
            torch.testing.assert_close(got, expected.half().float(), atol=2e-3, rtol=2e-3, msg=name)


def test_a_second_engine_records_into_the_same_set_under_fresh_ids(model, tmp_path):
    """Each LLM numbers its requests from 0: the second one's traces get suffixed ids (this
    looped forever when the set already held the id)."""
    first = tiny_llm(model, record_traces=tmp_path / "set", record_layers=[0])
    first.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    second = tiny_llm(model, record_traces=tmp_path / "set", record_layers=[0])
    outs = second.generate(PROMPTS, GREEDY, use_tqdm=False)
    traces = TraceSet(tmp_path / "set")
    ids = [e.request_id for e in traces.index]
    assert ids == ["0", "1", "0-1", "1-1", "2"]
    for out, trace_id in zip(outs, ["0-1", "1-1", "2"], strict=True):
        header = traces.read(trace_id).header
        assert list(header.token_ids) == out.prompt_token_ids + out.token_ids[:-1]
