"""``LLM.stream``: the chunks add up to what ``generate`` returns, text never runs ahead of a
stop string or an incomplete UTF-8 character, and leaving early gives everything back."""

from __future__ import annotations

import pytest
from llm_helpers import GREEDY, assert_all_returned, prompt, tiny_llm, tiny_models

from growpage.engine.sampling_params import SamplingParams
from growpage.errors import EngineError


class ByteTokenizer:
    """Token ``i`` is byte ``i % 256``, decoded as UTF-8 with replacement: like a byte-level
    BPE, a multi-byte character shows as U+FFFD until its last byte arrives."""

    eos_token_id = None

    def decode(self, ids):
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def model():
    return tiny_models()[0]


def _llm(model, **kwargs):
    return tiny_llm(model, policy="growpage", tokenizer=ByteTokenizer(), **kwargs)


PROMPTS = [prompt(5, 1), prompt(11, 2), prompt(23, 3)]


def _collect(chunks):
    texts, ids, outputs, order = {}, {}, {}, []
    for c in chunks:
        assert c.index not in outputs, "nothing comes after a request's last chunk"
        texts[c.index] = texts.get(c.index, "") + c.text
        ids[c.index] = ids.get(c.index, []) + c.token_ids
        order.append(c.index)
        if c.finished:
            outputs[c.index] = c.output
    return texts, ids, outputs, order


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=30, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True),
    ],
    ids=["greedy", "sampled"],
)
def test_chunks_add_up_to_what_generate_returns(model, params):
    expected = _llm(model).generate(PROMPTS, params, use_tqdm=False)
    llm = _llm(model)
    texts, ids, outputs, order = _collect(llm.stream(PROMPTS, params))
    assert [outputs[i].token_ids for i in range(3)] == [o.token_ids for o in expected]
    assert [ids[i] for i in range(3)] == [o.token_ids for o in expected]
    assert [texts[i] for i in range(3)] == [o.text for o in expected]
    assert [outputs[i].text for i in range(3)] == [o.text for o in expected]
    assert len(order) > 3, "text comes while the requests run, not only at the end"
    assert llm.last_stats is not None and llm.last_stats.num_output_tokens == 90
    assert_all_returned(llm)


def test_text_waits_for_a_stop_string_and_for_whole_characters(model):
    ref = _llm(model).generate(
        PROMPTS[:1], SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False
    )[0]
    text = ref.text
    # A stop string taken from the middle of the reference text: generation stops there.
    cut = next(i for i in range(8, len(text) - 2) if text[i] != "\ufffd" != text[i + 1])
    stop = text[cut : cut + 2]
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop])
    expected = _llm(model).generate(PROMPTS[:1], params, use_tqdm=False)[0]
    assert expected.finish_reason == "stop" and expected.text == text[: text.find(stop)]
    shown = ""
    for chunk in _llm(model).stream(PROMPTS[:1], params):
        shown += chunk.text
        assert stop not in shown and expected.text.startswith(shown)
        if not chunk.finished:
            assert "\ufffd" not in shown[-1:], "an incomplete character was shown"
    assert shown == expected.text


def test_leaving_a_stream_early_aborts_its_requests(model):
    llm = _llm(model)
    stream = llm.stream(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True))
    next(stream)
    with pytest.raises(EngineError, match="stream open"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stream.close()
    assert_all_returned(llm)
    assert llm.last_stats is None
    for _ in llm.stream(PROMPTS[:1], SamplingParams(max_tokens=5, ignore_eos=True)):
        break  # the loop's generator is closed when it is dropped
    assert_all_returned(llm)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
    again = _llm(model).generate(
        PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False
    )
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]


def test_a_call_refused_inside_a_stream_keeps_the_stream_s_stats(model):
    """Until 2026-12 generate and score cleared last_stats before finding the stream open."""
    llm = _llm(model)
    tried = 0
    for _ in llm.stream(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True)):
        if llm.last_stats is not None:  # set before the last chunks
            for call in (
                lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False),
                lambda: llm.score(PROMPTS, PROMPTS),
            ):
                with pytest.raises(EngineError, match="stream open"):
                    call()
                tried += 1
                assert llm.last_stats is not None
    assert tried and llm.last_stats is not None
    assert llm.last_stats.num_output_tokens == 3 * 8


def test_a_bad_prompt_fails_before_anything_runs(model):
    llm = _llm(model)
    with pytest.raises(EngineError, match=r"prompts\[1\]"):
        llm.stream([prompt(5, 1), []])
    assert_all_returned(llm)
