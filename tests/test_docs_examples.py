"""The Python examples of README.md and docs/ run as written (docs that match the code).

Each example is executed from the markdown itself, so an edit that breaks one fails here. The
policy guide's policy, "Check it" and property-test examples are run by
``tests/policies/test_policies.py``; its "Run it" example is run here.
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
    usage, profile, arrivals, stream = blocks("docs/engine.md")
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

    # The arrivals example, its answers cut short as the stream's: 8 requests at 2 per second.
    exec(compile(arrivals, "docs/engine.md arrivals", "exec"), short)
    stats = scope["llm"].last_stats
    assert stats.num_requests == 8 and "throughput (TPS)" in capsys.readouterr().out
    assert stats.total_s >= short["times"][-1] - short["times"][0]

    # The profiling example, with the names it takes from the surrounding text.
    # Long enough (EOS ignored) to cross a few page boundaries of 64.
    scope.update(prompts=["Count to ten."], params=SamplingParams(max_tokens=200, ignore_eos=True))
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
    assert (
        "A Hugging Face directory needs `config.json`, the `*.safetensors` weights and "
        "`tokenizer.json`"
    ) in text


def test_trace_format_examples_run(tmp_path) -> None:
    reading, sets = blocks("docs/trace-format.md")
    from growpage.core.traces import write_trace

    spec = SyntheticSpec(
        num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8, prompt_len=4, gen_len=12
    )
    trace = synthetic_trace(spec, seed=0, request_id="req-0")
    write_trace(tmp_path / "req.safetensors", trace)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        scope: dict = {}  # each snippet imports what it uses, as a reader's script would
        exec(compile(reading, "docs/trace-format.md reading", "exec"), scope)
        assert (tmp_path / "out.safetensors").is_file()
        exec(compile(sets, "docs/trace-format.md sets", "exec"), scope)
    finally:
        os.chdir(cwd)
    traces = scope["traces"]
    assert len(traces) == 1 and traces.index[0].tags == ("aime",)
    assert torch.equal(traces.read("req-0").keys, scope["trace"].keys)


def section(doc: str, heading: str) -> str:
    """The text of ``doc`` from the line ``heading`` to the next heading of any level."""
    text = (ROOT / doc).read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n#", start + len(heading) + 2)
    return text[start : end if end >= 0 else len(text)]


def names(text: str) -> set[str]:
    return set(re.findall(r"`(\w+)`", text))


def test_engine_guide_documents_every_llm_keyword_and_output_field() -> None:
    import inspect

    import attrs

    from growpage.engine.config import SETTINGS
    from growpage.engine.llm import LLM
    from growpage.engine.outputs import EngineStats, RequestOutput
    from growpage.engine.sampling_params import SamplingParams

    params = section("docs/engine.md", "## Parameters")
    keywords = set(inspect.signature(LLM.__init__).parameters) - {"self", "settings"}
    keywords |= {f.name for f in SETTINGS}  # LLM's **settings
    assert keywords <= names(params) | {"model", "policy", "policy_kwargs"}
    assert {f.name for f in attrs.fields(SamplingParams)} <= names(params)
    stats = section("docs/engine.md", "## Statistics (`EngineStats`)")
    assert {f.name for f in attrs.fields(EngineStats)} <= names(stats)
    text = (ROOT / "docs/engine.md").read_text()
    usage = text[text.index("A `RequestOutput` holds") :]
    assert {f.name for f in attrs.fields(RequestOutput)} <= names(usage.split("\n\n")[0])


def test_file_tables_list_every_module() -> None:
    engine = set(re.findall(r"`([\w/]+)\.py`", section("docs/engine.md", "## Files")))
    package = ROOT / "growpage/engine"
    modules = {
        p.relative_to(package).with_suffix("").as_posix()
        for p in package.rglob("*.py")
        if p.stem != "__init__"
    }
    assert modules <= engine, sorted(modules - engine)
    core = set(re.findall(r"`core/(\w+)\.py`", (ROOT / "docs/architecture.md").read_text()))
    modules = {p.stem for p in (ROOT / "growpage/core").glob("*.py")} - {"__init__"}
    assert modules <= core, sorted(modules - core)


def cli_options(command: str) -> set[str]:
    from growpage.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    return {o for a in sub._actions for o in a.option_strings if o.startswith("--")} - {"--help"}


def test_engine_guide_cli_synopsis_matches_the_parsers() -> None:
    from growpage.engine.cli_flags import NO_FLAG, flag_name
    from growpage.engine.config import SETTINGS

    text = (ROOT / "docs/engine.md").read_text()
    synopsis = text[
        text.index("growpage generate --prompt") : text.index(
            "```", text.index("growpage generate --prompt")
        )
    ]
    generate, record = synopsis.split("growpage record")
    for command, block in (("generate", generate), ("record", record)):
        shown = set(re.findall(r"--[a-z][a-z-]*", block))
        if "[ENGINE FLAGS]" in block:  # generated: one per engine setting (docs: Parameters)
            shown |= {flag_name(f) for f in SETTINGS if f.name not in NO_FLAG}
        shown |= {f"--no-{o[2:]}" for o in shown if f"--no-{o[2:]}" in cli_options(command)}
        assert shown == cli_options(command), (command, shown ^ cli_options(command))


def test_readme_commands_parse() -> None:
    import shlex

    from growpage.cli import build_parser

    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    commands = re.findall(r"^\.venv/bin/growpage (.+?)(?:\s+#.*)?$", text, flags=re.M)
    assert len(commands) >= 2
    for command in commands:
        args = build_parser().parse_args(shlex.split(command))
        assert args.func is not None
        if getattr(args, "policy_arg", None):
            from growpage.policies.registry import parse_policy_params, resolve_policy

            resolve_policy(args.policy, **parse_policy_params(args.policy_arg, "--param"))


def test_readme_names_every_builtin_policy() -> None:
    from growpage.policies.registry import registered_policies

    text = (ROOT / "README.md").read_text()
    listed = re.search(r"`growpage policies` lists the built-ins:(.*?)\.\n\n", text, re.S)
    assert listed is not None
    assert names(listed.group(1)) == set(registered_policies())


def test_trace_format_tables_match_the_code() -> None:
    import attrs

    from growpage.core.traces import TraceHeader

    header = section("docs/trace-format.md", "## One trace = one safetensors file")
    rows = set(re.findall(r"^\| `(\w+)`", header, flags=re.M))
    assert rows == {f.name for f in attrs.fields(TraceHeader)} | {"format", "version", "dtype"}
    table = section("docs/trace-format.md", "## Synthetic traces")
    documented = dict(re.findall(r"^\| `(\w+)`\s*\| ([^|]+?)\s*\|", table, flags=re.M))
    fields = {f.name: f.default for f in attrs.fields(SyntheticSpec)}
    assert set(documented) == set(fields)
    for name, default in fields.items():
        shown = documented[name].strip('`"')
        assert shown in (
            repr(default),
            str(default),
            str(default).lower(),
            default if isinstance(default, str) else None,
        ), (name, shown)


def test_readme_names_the_demos_policies() -> None:
    from growpage.demo import POLICIES

    text = " ".join((ROOT / "README.md").read_text().split())
    sentence = text[text.index("The demo replays") : text.index("(fidelity vs KV budget)")]
    assert names(sentence) == {name for _, name, _ in POLICIES}


def documented_defaults(table: str) -> dict[str, str]:
    """``name -> default`` of the rows ``| `a` / `b` | x / y | ... |`` of a markdown table."""
    defaults = {}
    for cells in re.findall(r"^\| (`\w+`(?: / `\w+`)*) \| ([^|]+) \|", table, flags=re.M):
        keys = re.findall(r"`(\w+)`", cells[0])
        values = [v.strip().strip("`") for v in cells[1].split(" / ")]
        defaults.update(zip(keys, values, strict=True))
    return defaults


def test_engine_guide_defaults_are_the_codes() -> None:
    import inspect

    import attrs

    from growpage.engine.config import SETTINGS
    from growpage.engine.llm import LLM
    from growpage.engine.sampling_params import SamplingParams

    llm_table, sampling_table = section("docs/engine.md", "## Parameters").split("`generate(")
    llm = {
        name: p.default
        for name, p in inspect.signature(LLM.__init__).parameters.items()
        if p.kind is p.KEYWORD_ONLY
    } | {f.name: f.default for f in SETTINGS}  # LLM's **settings
    sampling = {f.name: f.default for f in attrs.fields(SamplingParams)}
    for table, actual in ((llm_table, llm), (sampling_table, sampling)):
        documented = documented_defaults(table)
        for name, default in actual.items():
            shown = documented[name].split(" (")[0]
            assert shown in (repr(default), str(default), f'"{default}"'), (name, shown, default)


def test_simulator_guide_commands_parse_and_name_real_policies() -> None:
    """Every ``growpage ...`` command of the simulator guide's shell blocks is one the parser
    takes, with policies and sweep points that resolve (workload files are not read)."""
    import shlex

    from growpage.cli import build_parser
    from growpage.policies.registry import parse_policy_params, resolve_policy
    from growpage.sim.sweep import parse_points

    text = (ROOT / "docs/simulator.md").read_text()
    shell = "".join(part.split("```", 1)[0] for part in text.split("```bash\n")[1:])
    commands = re.findall(r"^growpage (.+?)(?:\s+#.*)?$", shell.replace("\\\n", " "), re.M)
    assert len(commands) >= 10
    for command in commands:
        args = build_parser().parse_args(shlex.split(command))
        assert args.func is not None, command
        if getattr(args, "policy", None):
            resolve_policy(args.policy, **parse_policy_params(args.param))
        for point in parse_points(getattr(args, "points", None) or []):
            resolve_policy(point.policy, **dict(point.params))


def test_serving_guide_bench_commands_parse() -> None:
    """The ``growpage bench`` commands of the serving guide are ones the parser takes."""
    import shlex

    from growpage.cli import build_parser

    text = (ROOT / "docs/serving.md").read_text()
    shell = "".join(part.split("```", 1)[0] for part in text.split("```bash\n")[1:])
    commands = re.findall(r"^growpage (bench .+?)(?:\s+#.*)?$", shell.replace("\\\n", " "), re.M)
    assert {shlex.split(c)[1] for c in commands} == {"serve", "throughput", "latency"}
    for command in commands:
        assert build_parser().parse_args(shlex.split(command)).func is not None, command


def test_simulator_guide_lists_every_serving_metric() -> None:
    import attrs

    from growpage.sim.metrics import ServingMetrics

    table = section(
        "docs/simulator.md", "### Metrics (`ServingMetrics`, paper Tables 7-9 and Fig. 5)"
    )
    documented = names(table) | {
        f"{k}_p{q}_{u}"
        for k, u in (("ttft", "s"), ("tpot", "ms"), ("e2e", "s"))
        for q in (50, 90, 99)
    }
    assert {f.name for f in attrs.fields(ServingMetrics)} <= documented


def test_policy_guide_run_example_replays_the_guides_policy(tmp_path, capsys) -> None:
    guide = blocks("docs/policy-guide.md")
    policy_code = guide[0]
    [run] = [b for b in guide if "replay_trace(trace, policy" in b]
    (tmp_path / "my_policy.py").write_text(policy_code)
    from growpage.policies.registry import resolve_policy

    scope: dict = {"policy": resolve_policy(f"{tmp_path}/my_policy.py:CappedGrowPage", max_pages=8)}
    exec(compile(run, "docs/policy-guide.md run", "exec"), scope)
    result = scope["result"]
    assert result.policy == "capped-growpage" and result.max_pages <= 8
    assert result.events["grow"] + result.events["compress"] == len(result.records)
    assert str(result.events["compress"]) in capsys.readouterr().out
