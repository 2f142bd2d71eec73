"""The real default model (SmolLM2-135M-Instruct GGUF) against transformers on the same file.

The reference weights come from transformers' own GGUF conversion (its dequantization and
q/k un-permutation), so these tests check our loader independently, not just our model.
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import greedy_paged, hf_logits

from growpage.engine.loading.loader import (
    build_model,
    default_model_path,
    load_checkpoint,
    load_model,
)
from growpage.engine.loading.tokenizer import load_tokenizer
from growpage.engine.modeling.step_context import prefill_context, use_context

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world, how are you?",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Numbers 12345 and 3.14159, symbols #$%^&* and émojis 😀 über café 日本語",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n",
    "def f(x):\n    return x ** 2  # code",
]
CHATS = ["What is the capital of France?", "Write a haiku about the sea."]
# Prompts whose greedy answers run past 32 tokens without an end-of-turn token.
LONG_CHATS = [
    "Write a haiku about the sea.",
    "Write a short story about a robot who learns to paint.",
]


@pytest.fixture(scope="module")
def smol():
    return load_model(), load_tokenizer()


@pytest.fixture(scope="module")
def ref():
    """transformers' LlamaForCausalLM and tokenizer loaded from the same GGUF file."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tok


def test_weights_equal_transformers_gguf_conversion(smol, ref):
    ours, _ = smol
    theirs = ref[0].state_dict()
    ours_sd = ours.state_dict()
    assert ours.config.num_layers == 30 and ours.config.num_kv_heads == 3
    assert ours.config.tie_word_embeddings
    for name, w in ours_sd.items():
        assert torch.equal(w, theirs[name]), name


def test_next_token_logits_match_transformers(smol, ref):
    ours, tok = smol
    prompts = [tok.encode_chat(CHATS[0]), tok.encode(TEXTS[2]), tok.encode(" ".join(TEXTS) * 2)]
    for ids in prompts:
        with use_context(prefill_context([len(ids)])), torch.inference_mode():
            got = ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids))))
        expected = hf_logits(ref[0], ids)
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)  # measured ~1e-4
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_greedy_32_tokens_identical_to_transformers(smol, ref):
    ours, tok = smol
    prompts = [tok.encode_chat(c) for c in LONG_CHATS]
    got = greedy_paged(ours, prompts, n=32, page_size=16)  # both decoded in one batch
    for ids, out in zip(prompts, got, strict=True):
        with torch.inference_mode():
            gen = ref[0].generate(
                torch.tensor([ids]),
                max_new_tokens=32,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
        expected = gen[0, len(ids) :].tolist()
        assert len(expected) == 32 and tok.eos_token_id not in expected
        assert out == expected


def test_tokenizer_matches_transformers(smol, ref):
    _, tok = smol
    hf_tok = ref[1]
    assert tok.vocab_size == len(hf_tok)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>") == [1] and tok.decode([1, 2, 0]) == ""
    assert tok.encode("12") == [tok.token_to_id("1"), tok.token_to_id("2")]  # digits split
    for chat in CHATS:
        msgs = [{"role": "user", "content": chat}]
        expected = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(chat) == expected
        assert tok.encode_chat(msgs) == hf_tok.encode(expected, add_special_tokens=False)
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2


def test_tokenizer_from_hf_directory(smol, tmp_path):
    _, tok = smol
    tok._tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": tok.chat_template,
                "bos_token": "<|im_start|>",
                "eos_token": {"content": "<|im_end|>"},
            }
        )
    )
    other = load_tokenizer(tmp_path)
    assert other.bos_token_id == 1 and other.eos_token_id == 2
    for text in TEXTS:
        assert other.encode(text) == tok.encode(text)
    assert other.apply_chat_template(CHATS[0]) == tok.apply_chat_template(CHATS[0])


def test_bf16_model_agrees_on_next_token(smol):
    """At every position of a chat where fp32's best token leads by more than bf16 can blur
    (half a logit: bf16 keeps 8 bits, 0.125 at these magnitudes), bf16 picks the same token.
    Where two tokens are nearly tied (the last position of this chat: 0.08 apart), the choice
    depends on the CPU's bf16 rounding, so only the clear positions are compared."""
    ours, tok = smol
    cfg, sd = load_checkpoint(None, dtype=torch.bfloat16)
    assert cfg == ours.config and sd["model.embed_tokens.weight"].dtype == torch.bfloat16
    bf16 = build_model(cfg, sd)
    ids = tok.encode_chat(CHATS[0])
    with use_context(prefill_context([len(ids)])), torch.inference_mode():
        got = bf16.compute_logits(bf16(torch.tensor(ids), torch.arange(len(ids))))
    with use_context(prefill_context([len(ids)])), torch.inference_mode():
        fp32 = ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids))))
    top2 = fp32.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5
    assert got.dtype == torch.float32 and int(clear.sum()) >= 20
    assert torch.equal(got[clear].argmax(-1), fp32[clear].argmax(-1))
