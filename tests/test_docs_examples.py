"""The Python examples of README.md and docs/ run as written (docs that match the code).

Each example is executed from the markdown itself, so an edit that breaks one fails here. The
policy guide's own example is run by ``tests/policies/test_policies.py``; the guide's
controller sketch needs a live request and view, so it is not run.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from growpage.sim.synthetic import SyntheticSpec, synthetic_trace
from growpage.testing import check_policy

ROOT = Path(__file__).resolve().parents[1]


def blocks(doc: str) -> list[str]:
    """The ```python blocks of ``doc`` (a path under the repository root), in order."""
    text = (ROOT / doc).read_text()
    return [part.split("```", 1)[0] for part in text.split("```python\n")[1:]]


def test_readme_quickstart_runs(capsys) -> None:
    quickstart, _ = blocks("README.md")
    scope: dict = {}
    exec(compile(quickstart, "README.md quickstart", "exec"), scope)
    outs, nll = scope["outs"], scope["nll"]
    assert outs[0].text and outs[0].finish_reason is not None
    assert isinstance(nll, float) and nll > 0
    assert "boundary time" in capsys.readouterr().out  # the stats table was printed


def test_readme_policy_is_a_working_policy() -> None:
    _, policy = blocks("README.md")
    scope: dict = {}
    exec(compile(policy, "README.md policy", "exec"), scope)
    check_policy(scope["MyPolicy"](), max_examples=10)


def test_engine_guide_examples_run(capsys) -> None:
    usage, profile, stream = blocks("docs/engine.md")
    scope: dict = {}
    exec(compile(usage, "docs/engine.md usage", "exec"), scope)
    assert len(scope["outs"]) == 2 and "C" in capsys.readouterr().out
    from growpage import SamplingParams

    # The streaming example on the usage example's LLM, its story cut short to keep this quick.
    short = dict(scope, SamplingParams=lambda **kw: SamplingParams(**{**kw, "max_tokens": 24}))
    exec(compile(stream, "docs/engine.md stream", "exec"), short)
    printed = capsys.readouterr().out
    assert printed.split("policy")[0].strip() and "throughput (TPS)" in printed
    assert scope["llm"].last_stats.num_requests == 1

    # The profiling example, with the names it takes from the surrounding text.
    # Long enough (EOS ignored) to cross a few page boundaries of 64.
    scope.update(prompts=["Count to ten."], params=SamplingParams(max_tokens=200,
                                                                   ignore_eos=True))
    exec(compile(profile, "docs/engine.md profile", "exec"), scope)
    phases = scope["phases"]
    assert phases.boundaries >= 3 and phases.decided >= 1
    assert "| control |" in capsys.readouterr().out


def test_engine_guide_lists_every_event_counter() -> None:
    import attrs

    from growpage.core.events import EventCounters

    text = (ROOT / "docs/engine.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `events` |"))
    assert {f.name for f in attrs.fields(EventCounters)} <= set(re.findall(r"`(\w+)`", row))


def test_engine_guide_names_the_files_of_a_hf_directory() -> None:
    text = " ".join((ROOT / "docs/engine.md").read_text().split())
    assert ("A Hugging Face directory needs `config.json`, the `*.safetensors` weights and "
            "`tokenizer.json`") in text


def test_trace_format_examples_run(tmp_path) -> None:
    reading, sets = blocks("docs/trace-format.md")
    from growpage.core.traces import write_trace

    spec = SyntheticSpec(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8,
                         prompt_len=4, gen_len=12)
    trace = synthetic_trace(spec, seed=0, request_id="req-0")
    write_trace(tmp_path / "req.safetensors", trace)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        scope: dict = {"torch": torch}
        exec(compile(reading, "docs/trace-format.md reading", "exec"), scope)
        assert (tmp_path / "out.safetensors").is_file()
        exec(compile(sets, "docs/trace-format.md sets", "exec"), scope)
    finally:
        os.chdir(cwd)
    traces = scope["traces"]
    assert len(traces) == 1 and traces.index[0].tags == ("aime",)
    assert torch.equal(traces.read("req-0").keys, scope["trace"].keys)
