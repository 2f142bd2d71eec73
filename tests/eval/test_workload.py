"""The evaluation workload: prompts, retrieval items and their forced continuations."""

from __future__ import annotations

import pytest

from growpage.eval.workload import reasoning_prompts, retrieval_continuation, retrieval_items


def fake_encode(text: str) -> list[int]:
    """One id per character: spans can be checked against the text itself."""
    return [ord(c) for c in text]


def test_reasoning_prompts_are_distinct_and_cycle():
    prompts = reasoning_prompts(48)
    assert len(set(prompts)) == 48 and all(len(p) > 40 for p in prompts)
    assert reasoning_prompts(50)[48:] == prompts[:2]
    with pytest.raises(ValueError, match="n must be >= 1"):
        reasoning_prompts(0)


def test_retrieval_items_ask_about_stated_facts_and_are_seeded():
    items = retrieval_items(12, seed=3)
    assert items == retrieval_items(12, seed=3) and items != retrieval_items(12, seed=4)
    for item in items:
        assert len(item.questions) == 2
        for _question, prefix, answer in item.questions:
            # The fact is stated verbatim in the prompt: prefix + answer + ".".
            assert f"{prefix}{answer}." in item.prompt
    with pytest.raises(ValueError, match="num_questions"):
        retrieval_items(2, num_facts=2, num_questions=3)


def test_retrieval_continuation_spans_point_at_the_answers():
    item = retrieval_items(1, seed=0)[0]
    stretch = [7] * 25
    ids, spans = retrieval_continuation(fake_encode, stretch, item)
    assert ids[:25] == stretch and len(spans) == 2
    for (start, stop), (_q, _prefix, answer) in zip(spans, item.questions, strict=True):
        assert "".join(map(chr, ids[start:stop])) == answer
    assert spans[0][1] <= spans[1][0] and spans[-1][1] == len(ids)
    with pytest.raises(ValueError, match="encodes to no tokens"):
        retrieval_continuation(lambda text: [] if text.startswith(" ") else [1], [], item)
