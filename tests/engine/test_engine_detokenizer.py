"""Incremental detokenization: the text equals a full decode (without a trailing incomplete
character) after every token, stop strings are found at the same token and position as a full
decode finds them, and the engine decodes each token a bounded number of times instead of the
whole output at every step."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llm_helpers import prompt, tiny_llm, tiny_models

from growpage.engine.loop.detokenizer import IncrementalDetokenizer
from growpage.engine.loop.llm_engine import LLMEngine
from growpage.engine.loop.sequence import Sequence
from growpage.engine.sampling_params import SamplingParams


def byte_decode(ids):
    """Token ``i`` is byte ``i % 256`` (a byte-level BPE split to single bytes)."""
    return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


class CountingTokenizer:
    """``byte_decode``, counting the ids it is asked to decode."""

    eos_token_id = None

    def __init__(self):
        self.decoded_ids = 0

    def decode(self, ids):
        self.decoded_ids += len(ids)
        return byte_decode(ids)


def check_against_full_decode(decode, ids):
    det = IncrementalDetokenizer(decode)
    shown = ""
    for n in range(1, len(ids) + 1):
        shown += det.update(ids[:n])
        full = decode(ids[:n])
        assert det.text == shown and det.num_chars == len(shown)
        for k in (0, 1, 3, len(shown) + 2):
            assert det.tail(k) == (shown[-k:] if k else "")
        assert det.text + det.pending == full, n
        assert not det.text.endswith("\ufffd")
        assert det.pending == "" or det.pending.endswith("\ufffd")
        if not full.endswith("\ufffd"):
            assert det.text == full and det.num_settled_tokens == n
    return det


# Text whose characters take 1 to 4 UTF-8 bytes, and bytes that are not UTF-8 at all.
_CHARS = st.sampled_from(list("ab .\n") + ["é", "ß", "€", "中", "😀", "\U0001f9ea"])
_PIECES = st.one_of(
    _CHARS.map(lambda c: list(c.encode())),
    st.lists(st.integers(0x80, 0xFF), min_size=1, max_size=3),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_PIECES, max_size=40))
def test_byte_tokens_settle_exactly_as_a_full_decode(pieces):
    check_against_full_decode(byte_decode, [b for p in pieces for b in p])


@pytest.fixture(scope="module")
def smol_tokenizer():
    from growpage.engine.loading.tokenizer import load_tokenizer

    return load_tokenizer()


def test_smollm2_tokens_settle_exactly_as_a_full_decode(smol_tokenizer):
    text = (
        "Grüße aus Köln! 中文测试, emoji 😀🧪 and maths: ∑ x² ≤ 3.\n"
        "  Indented line\twith tab; naïve café — done."
    )
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    det = check_against_full_decode(smol_tokenizer.decode, ids)
    assert det.text == text
    rng = random.Random(0)
    vocab = smol_tokenizer.vocab_size
    # Random ids: many are byte tokens and pieces of characters, and specials (skipped).
    check_against_full_decode(smol_tokenizer.decode, [rng.randrange(vocab) for _ in range(400)])


def test_ids_that_change_are_refused():
    det = IncrementalDetokenizer(byte_decode)
    det.update([104, 105])
    det.update([104, 105, 33])
    with pytest.raises(ValueError, match="must extend"):
        det.update([104, 105, 34, 35])  # the ids of the current window are checked
    with pytest.raises(ValueError, match="must extend"):
        det.update([104])
    assert det.text == "hi!"


def _bare_engine(decode):
    """An ``LLMEngine`` with only what stop detection uses (no model)."""
    engine = object.__new__(LLMEngine)
    engine.detokenize = decode
    return engine


@settings(max_examples=150, deadline=None)
@given(st.lists(_PIECES, min_size=1, max_size=30), st.data())
def test_stop_strings_are_found_where_a_full_decode_finds_them(pieces, data):
    ids = [b for p in pieces for b in p]
    final = byte_decode(ids)
    # Stop strings: pieces of the text (so most runs stop), or strings that never occur.
    stops = data.draw(
        st.lists(
            st.one_of(
                st.integers(0, max(len(final) - 1, 0)).flatmap(
                    lambda i: st.integers(1, 4).map(lambda k: final[i : i + k] or "z")
                ),
                st.sampled_from(["zz", "€x", "\n\n"]),
            ),
            min_size=1,
            max_size=3,
        )
    )
    engine = _bare_engine(byte_decode)
    seq = Sequence(0, "r", [1], SamplingParams(stop=stops))
    expected = None  # the first step at which a full decode contains a stop, and where
    for n in range(1, len(ids) + 1):
        hits = [i for i in (byte_decode(ids[:n]).find(s) for s in stops) if i >= 0]
        if hits:
            expected = (n, min(hits))
            break
    got = None
    for n in range(1, len(ids) + 1):
        seq.output_token_ids.append(ids[n - 1])
        if engine._cut_at_stop(seq):
            got = (n, seq.stop_text_len)
            break
    assert got == expected


@pytest.fixture(scope="module")
def model():
    return tiny_models()[0]


@pytest.mark.parametrize("mode", ["stop", "stream"])
def test_each_token_is_decoded_a_bounded_number_of_times(model, mode):
    """Before, the engine decoded the whole output after every token: n^2/2 ids for n tokens
    (about 11,000 for 150 tokens); now a few windows per token plus one final decode."""
    tok = CountingTokenizer()
    llm = tiny_llm(model, policy="growpage", tokenizer=tok)
    n = 150
    params = SamplingParams(
        max_tokens=n,
        ignore_eos=True,
        stop=["\x00\x00\x00\x00\x00\x00\x00\x00"] if mode == "stop" else [],
    )
    if mode == "stop":
        out = llm.generate([prompt(7, 1)], params, use_tqdm=False)[0]
    else:
        chunks = list(llm.stream([prompt(7, 1)], params))
        out = chunks[-1].output
        assert "".join(c.text for c in chunks) == out.text
    assert len(out.token_ids) == n and out.finish_reason == "length"
    assert out.text == byte_decode(out.token_ids)
    assert tok.decoded_ids <= 12 * n, tok.decoded_ids
