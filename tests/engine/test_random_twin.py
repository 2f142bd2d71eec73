"""``benchmarks/random_twin.py``: a model's config and tokenizer exported small enough for a
device call, and random weights drawn from a seed that load as any Hugging Face folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
from benchmark_scripts import load_benchmark

from growpage.core.rope import RopeConfig
from growpage.engine.llm import LLM
from growpage.engine.loading import catalog
from growpage.engine.loading.loader import hf_config_to_model_config, load_checkpoint
from growpage.engine.loading.tokenizer import load_tokenizer
from growpage.engine.modeling.model import ModelConfig
from growpage.engine.sampling_params import SamplingParams
from growpage.errors import EngineError

random_twin = load_benchmark("random_twin")
ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "Hello world! 12,345 apples cost $6.50 each; 3/4 of them are red.\n\tdef f(x): return x**2",
    "<|im_start|>user\nWhat is 7 * 8?<|im_end|>\n<|im_start|>assistant\n",
    "   spaces, ünïcödé and an emoji 😀",
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_twin.export("smollm2-135m", tmp_path_factory.mktemp("twin") / "smollm2")


def test_export_is_the_models_config_and_tokenizer_without_weights(exported: Path):
    source_cfg, _ = load_checkpoint("smollm2-135m")
    twin_cfg = hf_config_to_model_config(
        json.loads((exported / "config.json").read_text()), exported
    )
    assert attrs.evolve(twin_cfg, name="") == attrs.evolve(source_cfg, name="")
    source, twin = load_tokenizer("smollm2-135m"), load_tokenizer(exported)
    for text in TEXTS:
        ids = source.encode(text)
        assert twin.encode(text) == ids
        assert twin.decode(ids) == source.decode(ids)
        assert twin.encode_chat(text) == source.encode_chat(text)
    assert (twin.bos_token_id, twin.eos_token_id, twin.vocab_size) == (
        source.bos_token_id,
        source.eos_token_id,
        source.vocab_size,
    )
    assert not list(exported.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in exported.iterdir())
    assert size < 8 * 2**20, "small enough to travel with the working tree"
    info = json.loads((exported / "twin.json").read_text())
    assert info["source_sha256"] == catalog.CATALOG["smollm2-135m"].sha256


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(
            arch="llama",
            vocab_size=300,
            hidden_size=32,
            intermediate_size=48,
            num_layers=2,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=8,
            rope=RopeConfig(
                head_dim=8,
                theta=500000.0,
                scaling_factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position=8192,
            ),
            rms_eps=1e-5,
            bos_token_id=1,
            eos_token_ids=(2, 3),
            name="llama3-like",
        ),
        ModelConfig(
            arch="qwen2",
            vocab_size=300,
            hidden_size=32,
            intermediate_size=48,
            num_layers=1,
            num_q_heads=4,
            num_kv_heads=1,
            head_dim=8,
            rope=RopeConfig(head_dim=8, theta=1e6),
            tie_word_embeddings=True,
            attention_bias=True,
            max_position=32768,
            eos_token_ids=(5,),
            name="qwen2-like",
        ),
        ModelConfig(
            arch="qwen3",
            vocab_size=300,
            hidden_size=32,
            intermediate_size=48,
            num_layers=1,
            num_q_heads=2,
            num_kv_heads=2,
            head_dim=16,
            rope=RopeConfig(head_dim=16),
            qk_norm=True,
            name="qwen3-like",
        ),
    ],
    ids=lambda c: c.name,
)
def test_hf_config_reads_back_to_the_same_model_config(cfg: ModelConfig, tmp_path: Path):
    back = hf_config_to_model_config(random_twin.hf_config(cfg), tmp_path)
    assert attrs.evolve(back, name="") == attrs.evolve(cfg, name="")


def test_weights_are_drawn_from_the_seed_and_the_twin_generates(exported: Path, tmp_path: Path):
    folder = tmp_path / "small"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "twin.json"):
        (folder / name).write_bytes((exported / name).read_bytes())
    hf = json.loads((exported / "config.json").read_text())
    hf.update(hidden_size=32, intermediate_size=48, num_hidden_layers=2, head_dim=8)
    hf.update(num_attention_heads=4, num_key_value_heads=2)
    (folder / "config.json").write_text(json.dumps(hf))

    path = random_twin.weights(folder, seed=3, dtype=torch.float32)
    first = path.read_bytes()
    random_twin.weights(folder, seed=3, dtype=torch.float32)
    assert path.read_bytes() == first, "the same seed draws the same weights"
    random_twin.weights(folder, seed=4, dtype=torch.float32)
    assert path.read_bytes() != first
    assert not list(folder.glob("*.partial"))
    assert json.loads((folder / "twin.json").read_text())["seed"] == 4

    llm = LLM(str(folder), device="cpu", page_size=16)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    (out,) = llm.generate(["What is 7 * 8?"], params)
    assert len(out.token_ids) == 6
    assert all(torch.isfinite(p).all() for p in llm.engine.runner.model.parameters())


def test_weights_without_an_export_name_the_step_to_run(tmp_path: Path):
    with pytest.raises(EngineError, match="no config.json .*random_twin.py export"):
        random_twin.weights(tmp_path, seed=0, dtype=torch.bfloat16)
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "random_twin.py"), "weights", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"random_twin.py: error: {tmp_path}: no config.json (run `random_twin.py export` first)"
    ]
    assert not list(tmp_path.iterdir())
