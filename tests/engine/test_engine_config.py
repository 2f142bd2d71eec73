"""``EngineConfig`` validation: every bad setting is a ``ConfigError`` naming the setting, raised
before a model is loaded."""

from __future__ import annotations

import pytest
import torch

from growpage.core.config import GrowPageConfig
from growpage.engine.config import EngineConfig, check_device
from growpage.errors import ConfigError


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("kv_pages", 0, "kv_pages must be a positive integer"),
        ("kv_pages", True, "kv_pages must be a positive integer"),
        ("kv_cache_memory", -1, "kv_cache_memory must be a positive integer"),
        ("max_num_seqs", 0, "max_num_seqs must be a positive integer"),
        ("max_num_batched_tokens", 2.5, "max_num_batched_tokens must be a positive integer"),
        ("dtype", "int8", "unknown dtype 'int8'"),
        ("attention_backend", "cudnn", "attention_backend must be one of"),
        ("device", "gpu0", "'gpu0' is not a torch device"),
        ("device", "meta", "'meta' is not supported"),
        ("cuda_graphs", "yes", "cuda_graphs must be True, False or None \\(automatic\\)"),
        ("async_compaction", 1, "async_compaction must be True, False or None"),
    ],
)
def test_bad_setting_names_it(field, value, words):
    with pytest.raises(ConfigError, match=words):
        EngineConfig(**{field: value})


def test_a_pool_below_min_capacity_is_refused_up_front(monkeypatch):
    from growpage.engine import llm as llm_module

    with pytest.raises(
        ConfigError,
        match="kv_pages: 1 page cannot hold one request, which grows to min_capacity = 2 pages",
    ):
        EngineConfig(kv_pages=1)
    three = GrowPageConfig(min_capacity=3)
    with pytest.raises(ConfigError, match="2 pages cannot hold .* min_capacity = 3"):
        EngineConfig(kv_pages=2, growpage=three)
    assert EngineConfig(kv_pages=3, growpage=three).num_pages_for(100) == 3
    budget = EngineConfig(kv_cache_memory=250, growpage=three)
    with pytest.raises(
        ConfigError, match="250 bytes hold 2 pages of 100 bytes; need at least min_capacity = 3"
    ):
        budget.num_pages_for(100)
    monkeypatch.setattr(llm_module, "_load", lambda *a: pytest.fail("model loaded"))
    with pytest.raises(ConfigError, match="min_capacity"):
        llm_module.LLM(page_size=16, kv_pages=1)
    # two sizes for one cache: refused, not one of them dropped (and before the model loads)
    with pytest.raises(
        ConfigError,
        match=r"kv_pages \(10\) or kv_cache_memory \(100000000 "
        r"bytes\), not both",
    ):
        EngineConfig(kv_pages=10, kv_cache_memory=10**8)
    with pytest.raises(ConfigError, match="not both"):
        llm_module.LLM(kv_pages=10, kv_cache_memory=10**8)


def test_cuda_graphs_are_refused_before_the_model_loads(monkeypatch):
    from growpage.engine import llm as llm_module

    monkeypatch.setattr(llm_module, "_load", lambda *a: pytest.fail("model loaded"))
    with pytest.raises(
        ConfigError,
        match="cuda_graphs needs a CUDA device and attention_backend="
        "'triton' \\(device 'cpu', backend 'auto'\\)",
    ):
        llm_module.LLM(cuda_graphs=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="backend 'torch'"):
        EngineConfig(cuda_graphs=True, device="cuda", attention_backend="torch")
    with pytest.raises(ConfigError, match="cuda_graphs cannot record traces"):
        EngineConfig(cuda_graphs=True, device="cuda", record_traces="traces")
    assert EngineConfig(cuda_graphs=True, device="cuda").cuda_graphs


def test_cuda_without_a_gpu_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="'cuda' asked for, but torch sees no CUDA device"):
        EngineConfig(device="cuda")


def test_cuda_index_past_the_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert check_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="'cuda:1' asked for, but torch sees 1 CUDA device"):
        EngineConfig(device="cuda:1")


def test_device_accepts_a_torch_device():
    assert EngineConfig(device=torch.device("cpu")).device == "cpu"


def test_llm_rejects_the_device_before_loading(monkeypatch):
    from growpage.engine import llm as llm_module

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(llm_module, "_load", no_load)
    with pytest.raises(ConfigError, match="no CUDA device"):
        llm_module.LLM(device="cuda")


def test_llm_device_auto_is_cuda_when_torch_sees_a_gpu(monkeypatch):
    from growpage.engine import llm as llm_module

    def stop(model, tokenizer, config):
        raise ConfigError(f"device {config.device}")

    monkeypatch.setattr(llm_module, "_load", stop)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="device cpu"):
        llm_module.LLM(device="auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="device cuda"):
        llm_module.LLM(device="auto")


def test_cli_seed_has_help(capsys):
    from growpage import cli

    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "--seed SEED seed of the requests' sampling (default: none; a run is reproducible" in text
    )


@pytest.mark.parametrize(
    "graphs,deferred,can_run,want",
    [
        (None, None, True, (True, True)),  # CUDA + Triton: graphs, and compaction beside them
        (None, None, False, (False, False)),  # CPU, torch backend or recording: neither
        (False, None, True, (False, False)),  # no graphs asked for: synchronous compaction
        (None, False, True, (True, False)),
        (False, True, False, (False, True)),  # an explicit choice stays
    ],
)
def test_cuda_graphs_and_async_compaction_default_to_where_they_help(
    monkeypatch, graphs, deferred, can_run, want
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = EngineConfig(
        cuda_graphs=graphs,
        async_compaction=deferred,
        kv_pages=8,
        device="cuda" if can_run else "cpu",
    )
    done = config.resolved(can_run)
    assert (done.cuda_graphs, done.async_compaction) == want
    assert done.kv_pages == 8 and done.resolved(not can_run) == done  # decided once


def test_a_cpu_engine_resolves_both_to_off():
    from llm_helpers import tiny_llm, tiny_model

    llm = tiny_llm(tiny_model(), "growpage")
    assert (llm.config.cuda_graphs, llm.config.async_compaction) == (False, False)
    assert llm.engine.config is llm.config and llm.engine.runner.graphs is None
    llm = tiny_llm(tiny_model(), "growpage", async_compaction=True)
    assert (llm.config.cuda_graphs, llm.config.async_compaction) == (False, True)


def test_cli_device_and_backend_reach_the_engine(monkeypatch, capsys):
    from growpage import cli
    from growpage.engine import cli as engine_cli

    seen = {}

    def fake_llm(**kwargs):
        seen.update(kwargs)
        raise ConfigError("stop here")

    monkeypatch.setattr(engine_cli, "_build_llm", fake_llm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["generate", "--prompt", "hi"]) == 2
    assert (seen["device"], seen["attention_backend"]) == ("cpu", "auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.main(["generate", "--prompt", "hi", "--attention-backend", "torch"]) == 2
    assert (seen["device"], seen["attention_backend"]) == ("cuda", "torch")
    assert cli.main(["generate", "--prompt", "hi", "--device", "cuda:1"]) == 2
    assert seen["device"] == "cuda:1"
    assert seen["cuda_graphs"] is None and seen["async_compaction"] is None  # the engine decides
    assert cli.main(["generate", "--prompt", "hi", "--no-cuda-graphs", "--async-compaction"]) == 2
    assert (seen["cuda_graphs"], seen["async_compaction"]) == (False, True)
    assert seen["async_decisions"] is False
    assert cli.main(["generate", "--prompt", "hi", "--async-decisions"]) == 2
    assert seen["async_decisions"] is True
    assert "stop here" in capsys.readouterr().err


def test_cli_record_bad_layers(tmp_path, capsys):
    from growpage import cli

    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    assert (
        cli.main(
            [
                "record",
                "--prompts",
                str(prompts),
                "--out",
                str(tmp_path / "o"),
                "--layers",
                "0,last",
            ]
        )
        == 2
    )
    assert (
        "--layers: expected comma-separated layer numbers, got '0,last'" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"page_sise": 64}, "['page_sise']; did you mean 'page_size'?"),  # a GrowPageConfig field
        ({"kv_page": 8}, "['kv_page']; did you mean 'kv_pages'?"),  # an LLM keyword
        ({"colour": 1}, "['colour']; LLM takes its own keywords and GrowPageConfig's fields"),
    ],
)
def test_a_misspelled_llm_keyword_is_named_with_what_was_meant(kwargs, words):
    from growpage import LLM

    with pytest.raises(TypeError) as info:  # before any model is loaded
        LLM(**kwargs)
    assert str(info.value).startswith(f"LLM() got unexpected keyword argument(s) {words}")
