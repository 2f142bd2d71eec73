"""Qwen2 (Qwen2.5-Coder's architecture) against transformers on a tiny random model: a
``save_pretrained`` directory and GGUF files of the same weights (F32, Q8_0; q/k rows not
permuted), plus a Qwen2-style GGUF tokenizer and chat template against transformers' own
reading of the same file, the end tokens, and the configs refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from engine_helpers import PagedDriver, greedy_paged, hf_logits, random_state_dict

from growpage.core.rope import RopeConfig
from growpage.engine.llm import LLM
from growpage.engine.loading import loader
from growpage.engine.loading.loader import build_model, load_checkpoint, load_model
from growpage.engine.loading.tokenizer import tokenizer_from_gguf
from growpage.engine.modeling.model import ModelConfig
from growpage.engine.modeling.step_context import prefill_context, use_context
from growpage.engine.sampling_params import SamplingParams
from growpage.errors import EngineError

gguf = pytest.importorskip("gguf")

ATOL = 1e-4  # as test_engine_model.py
IDS = [5, 17, 99, 3, 64, 12, 12, 101, 7, 45, 88, 270, 3, 150]
# A byte-level vocabulary in Qwen2's manner: 256 byte symbols, a few merges, the end and turn
# tokens as control tokens, a user-defined one, unused padding up to the model's vocabulary.
_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġ Ġ", "Ġ t", "Ġt he"]
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def vocabulary() -> tuple[list[str], list[int]]:
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = sorted(ByteLevel.alphabet()) + ["he", "ll", "hell", "hello", "Ġw", "ĠĠ", "Ġt", "Ġthe"]
    types = [1] * len(tokens) + [3] * len(_SPECIAL) + [4]
    tokens += [*_SPECIAL, "<tool_call>"]
    types += [5] * (300 - len(tokens))
    tokens += [f"[PAD{i}]" for i in range(len(tokens), 300)]
    return tokens, types


TOKENS, TOKEN_TYPES = vocabulary()
END_OF_TEXT, IM_START, IM_END = (TOKENS.index(t) for t in _SPECIAL)


def qwen2_config(tied: bool) -> ModelConfig:
    return ModelConfig(
        arch="qwen2",
        vocab_size=len(TOKENS),
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope=RopeConfig(head_dim=16, theta=1e6),
        rms_eps=1e-6,
        tie_word_embeddings=tied,
        attention_bias=True,
        max_position=512,
        bos_token_id=END_OF_TEXT,
        eos_token_ids=(IM_END,),
        name=f"tiny-qwen2{'-tied' if tied else ''}",
    )


def hf_qwen2(cfg: ModelConfig, sd: dict[str, torch.Tensor]):
    """transformers' ``Qwen2ForCausalLM`` with the weights ``sd`` (eager attention)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf_cfg = Qwen2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_q_heads,
        num_key_value_heads=cfg.num_kv_heads,
        rms_norm_eps=cfg.rms_eps,
        rope_theta=cfg.rope.theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_ids[0],
        pad_token_id=END_OF_TEXT,
    )
    model = Qwen2ForCausalLM._from_config(hf_cfg, dtype=torch.float32, attn_implementation="eager")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def our_logits(model, ids=IDS) -> torch.Tensor:
    with use_context(prefill_context([len(ids)])), torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def saved(request, tmp_path_factory):
    """``(directory, transformers model, weights)``: a tiny Qwen2 saved by transformers."""
    cfg = qwen2_config(tied=request.param)
    sd = random_state_dict(cfg, seed=11)
    assert sd["model.layers.0.self_attn.k_proj.bias"].abs().min() > 0  # biases matter here
    ref = hf_qwen2(cfg, sd)
    path = tmp_path_factory.mktemp("qwen2")
    ref.save_pretrained(path)
    # As Qwen2.5's own config.json says it: a window size present but switched off.
    hf = json.loads((path / "config.json").read_text())
    hf.pop("layer_types", None)
    hf.update(use_sliding_window=False, sliding_window=256, max_window_layers=1)
    (path / "config.json").write_text(json.dumps(hf))
    return path, ref, sd


def test_hf_directory_loads_with_biases_and_tying(saved):
    path, _, sd = saved
    hf = json.loads((path / "config.json").read_text())
    assert hf["model_type"] == "qwen2" and "attention_bias" not in hf
    assert hf["use_sliding_window"] is False and hf["sliding_window"] is not None
    cfg, got = load_checkpoint(path)
    assert cfg.arch == "qwen2" and cfg.attention_bias and not cfg.qk_norm
    assert cfg.tie_word_embeddings == hf["tie_word_embeddings"]
    assert cfg.rope.theta == 1e6 and cfg.num_kv_heads == 2 and cfg.head_dim == 16
    assert set(got) == set(sd)
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    assert not any(".o_proj.bias" in k for k in got)


def test_prefill_matches_transformers(saved):
    path, ref, _ = saved
    model = load_model(path)
    expected = hf_logits(ref, IDS)
    assert expected.std() > 0.5
    torch.testing.assert_close(our_logits(model), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [3, 8])
def test_paged_prefill_and_decode_match_transformers(saved, page_size):
    path, ref, _ = saved
    model = load_model(path)
    seqs = {0: IDS[:9], 1: IDS[:2], 2: [7] * 13}
    drv = PagedDriver(model, num_pages=64, page_size=page_size, seed=page_size)
    last = drv.prefill(seqs)
    for s, ids in seqs.items():
        torch.testing.assert_close(last[s], hf_logits(ref, ids), atol=ATOL, rtol=0)
    nxt = {s: int(v[-1].argmax()) for s, v in last.items()}
    for _ in range(5):
        for s, t in nxt.items():
            seqs[s].append(t)
        got = drv.decode(nxt)
        for s, ids in seqs.items():
            torch.testing.assert_close(got[s], hf_logits(ref, ids)[-1], atol=ATOL, rtol=0)
        nxt = {s: int(v.argmax()) for s, v in got.items()}


def test_greedy_tokens_equal_transformers_generate(saved):
    path, ref, _ = saved
    prompts = [IDS, IDS[3:5], [9] * 20]
    got = greedy_paged(load_model(path), prompts, n=16, page_size=4)
    for p, out in zip(prompts, got, strict=True):
        with torch.inference_mode():
            gen = ref.generate(
                torch.tensor([p]),
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                pad_token_id=END_OF_TEXT,
            )
        assert out == gen[0, len(p) :].tolist()


# ---------------------------------------------------------------- GGUF


def gguf_name(hf_name: str) -> str:
    top = {v: k for k, v in loader._GGUF_TOP.items()}
    stem, _, suffix = hf_name.rpartition(".")
    if stem in top:
        return f"{top[stem]}.{suffix}"
    _, _, layer, module = stem.split(".", 3)
    block = {v: k for k, v in loader._GGUF_BLOCK.items()}
    return f"blk.{layer}.{block[module]}.{suffix}"


def write_qwen2_gguf(path, cfg: ModelConfig, sd: dict[str, torch.Tensor], qtype: int) -> None:
    """llama.cpp's layout for ``qwen2``: HF rows as they are (no q/k permutation), matrices in
    ``qtype`` (F32 or Q8_0), vectors in F32, the tokenizer above with one EOS id."""
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name(cfg.name)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_q_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(TOKENS)
    w.add_token_merges(_MERGES)
    w.add_token_types(TOKEN_TYPES)
    w.add_bos_token_id(END_OF_TEXT)
    w.add_eos_token_id(IM_END)
    w.add_pad_token_id(END_OF_TEXT)
    w.add_add_bos_token(False)
    w.add_chat_template(_TEMPLATE)
    for name, t in sd.items():
        a = t.numpy()
        if a.ndim == 2 and qtype == gguf.GGMLQuantizationType.Q8_0:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def q8_0_round_trip(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    q8 = gguf.GGMLQuantizationType.Q8_0
    return {
        k: v
        if v.ndim == 1
        else torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(v.numpy(), q8), q8))
        for k, v in sd.items()
    }


def test_f32_gguf_is_the_safetensors_model(saved, tmp_path):
    path, _, sd = saved
    cfg = load_checkpoint(path)[0]
    write_qwen2_gguf(tmp_path / "tiny.gguf", cfg, sd, gguf.GGMLQuantizationType.F32)
    got_cfg, got = load_checkpoint(tmp_path / "tiny.gguf")
    assert got_cfg.arch == "qwen2" and got_cfg.attention_bias
    assert got_cfg.tie_word_embeddings == cfg.tie_word_embeddings
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    assert torch.equal(our_logits(load_model(tmp_path / "tiny.gguf")), our_logits(load_model(path)))


def test_q8_0_gguf_matches_transformers(saved, tmp_path):
    path, _, sd = saved
    cfg = load_checkpoint(path)[0]
    write_qwen2_gguf(tmp_path / "tiny.gguf", cfg, sd, gguf.GGMLQuantizationType.Q8_0)
    rounded = q8_0_round_trip(sd)
    assert not torch.equal(
        rounded["model.layers.0.self_attn.q_proj.weight"],
        sd["model.layers.0.self_attn.q_proj.weight"],
    )
    model = load_model(tmp_path / "tiny.gguf")
    expected = hf_logits(hf_qwen2(cfg, rounded), IDS)
    torch.testing.assert_close(our_logits(model), expected, atol=ATOL, rtol=0)
    prompts = [IDS, [4, 4, 4]]
    ref = hf_qwen2(cfg, rounded)
    for p, out in zip(prompts, greedy_paged(model, prompts, n=8, page_size=4), strict=True):
        with torch.inference_mode():
            logits = [ref(torch.tensor([p + out[:i]])).logits[0, -1].argmax() for i in range(8)]
        assert out == [int(t) for t in logits]


def test_gguf_qwen2_without_biases_is_refused(tmp_path):
    cfg = qwen2_config(tied=True)
    sd = {k: v for k, v in random_state_dict(cfg, seed=1).items() if not k.endswith(".bias")}
    write_qwen2_gguf(tmp_path / "nobias.gguf", cfg, sd, gguf.GGMLQuantizationType.F32)
    with pytest.raises(EngineError, match=r"missing \['model.layers.0.self_attn.k_proj.bias"):
        load_model(tmp_path / "nobias.gguf")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    cfg = qwen2_config(tied=False)
    path = tmp_path_factory.mktemp("qwen2-gguf") / "tiny-qwen2.gguf"
    write_qwen2_gguf(path, cfg, random_state_dict(cfg, seed=3), gguf.GGMLQuantizationType.F32)
    return path


TEXTS = [
    "hello world",
    "  hello   the\tthe\n\nwow",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "12345 + 678 = 7023, hello's they'LL",
    '<tool_call>{"a": 1}</tool_call><|endoftext|>',
    "héllo wörld, 你好 🙂 e\u0301 \r\n x",
    "",
]


def test_gguf_tokenizer_encodes_as_transformers(tiny_gguf):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    ours = tokenizer_from_gguf(tiny_gguf)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    assert ours.encode("<|im_start|><|im_end|><|endoftext|>") == [IM_START, IM_END, END_OF_TEXT]
    assert ours.encode("hello the") == [TOKENS.index("hello"), TOKENS.index("Ġthe")]
    assert len(ours.encode("<tool_call>")) == 1


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers(tiny_gguf, add_generation_prompt):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    ours = tokenizer_from_gguf(tiny_gguf)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "the world"},
        {"role": "user", "content": "wow"},
    ]
    want = theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.apply_chat_template(messages, add_generation_prompt) == want
    assert ours.encode(want, add_special_tokens=False) == theirs.encode(want)


def test_end_tokens_include_end_of_turn_and_end_of_text(tiny_gguf):
    """The file names only <|im_end|>; Qwen2.5's generation config ends on <|endoftext|> too."""
    assert load_model(tiny_gguf).config.eos_token_ids == (IM_END, END_OF_TEXT)
    llm = LLM(tiny_gguf, policy="fullkv", page_size=4, kv_pages=64)
    assert {IM_END, END_OF_TEXT} <= llm.engine.eos_token_ids
    out = llm.generate(["hello"], SamplingParams(max_tokens=3), chat=True, use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode_chat("hello")
    assert out.prompt_token_ids[:2] == [IM_START, TOKENS.index("u")]


@pytest.mark.parametrize("end", [IM_END, END_OF_TEXT], ids=["im_end", "endoftext"])
def test_generation_stops_at_either_end_token(tiny_gguf, end):
    """The LM head rigged so that ``end`` is the greedy answer to the chat prompt: the answer
    is that one token, finished as a stop, not ``max_tokens`` long."""
    model, tok = load_model(tiny_gguf), tokenizer_from_gguf(tiny_gguf)
    ids = tok.encode_chat("hello")
    with use_context(prefill_context([len(ids)])), torch.inference_mode():
        last = model(torch.tensor(ids), torch.arange(len(ids)))[-1]
        model.lm_head.weight.zero_()
        model.lm_head.weight[end] = last  # logit |last|^2 > 0, every other logit 0
    llm = LLM(model, tokenizer=tok, policy="fullkv", page_size=4, kv_pages=64)
    out = llm.generate([ids], SamplingParams(max_tokens=5), use_tqdm=False)[0]
    assert out.token_ids == [end] and out.finish_reason == "stop"


# ---------------------------------------------------------------- configs refused or accepted


DROP = object()


def _config_dir(tmp_path, saved, **changes):
    """A copy of the saved model with ``config.json`` changed (``DROP`` removes a key)."""
    path, _, _ = saved
    hf = {**json.loads((path / "config.json").read_text()), **changes}
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(
        json.dumps({k: v for k, v in hf.items() if v is not DROP})
    )
    return tmp_path


def test_an_enabled_sliding_window_is_refused(tmp_path, saved):
    path = _config_dir(tmp_path, saved, use_sliding_window=True, sliding_window=8)
    with pytest.raises(EngineError, match="sliding-window attention is not supported"):
        load_model(path)


def test_sliding_window_layers_follow_transformers():
    layers = loader._sliding_window_layers
    on = {"use_sliding_window": True, "sliding_window": 16}
    assert layers({**on, "max_window_layers": 3}, 5) == [3, 4]
    assert layers({**on, "max_window_layers": 5}, 5) == []
    assert layers({**on, "layer_types": ["full_attention", "sliding_attention"]}, 2) == [1]
    assert layers({**on, "sliding_window": None}, 2) == []
    assert layers({"use_sliding_window": False, "sliding_window": 16}, 2) == []


def test_build_model_needs_the_biases():
    cfg = qwen2_config(tied=False)
    sd = random_state_dict(cfg, seed=2)
    sd.pop("model.layers.1.self_attn.v_proj.bias")
    with pytest.raises(EngineError, match="v_proj.bias"):
        build_model(cfg, sd)
