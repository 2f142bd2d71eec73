"""``growpage check``: the conformance kit as one command, with its exit statuses."""

from __future__ import annotations

import textwrap

import pytest

from growpage.cli import main

BROKEN = textwrap.dedent("""
    from growpage import CapacityPolicy, Decision


    class StringlyTyped(CapacityPolicy):
        name = "stringly"

        def decide(self, ctx):
            return Decision.GROW if ctx.num_pages < 3 else "compress"


    class AsksForAViewThatIsNot(CapacityPolicy):
        name = "longterm"

        def decide(self, ctx):
            return Decision.GROW if ctx.attention("longterm").sum() > 0 else Decision.COMPRESS


    class SelectIndexesPastItsBuffer(CapacityPolicy):
        name = "past-its-buffer"

        def decide(self, ctx):
            return Decision.COMPRESS

        def select(self, ctx, keep):
            return [0, 1, 2][keep]


    class CrashesOnTheThirdRequest(CapacityPolicy):
        '''Fine on any one boundary; a served workload's third request ("r2") breaks it.'''

        name = "third-request"

        def decide(self, ctx):
            if ctx.request_id == "r2":
                raise RuntimeError("boom")
            return Decision.GROW
""")


@pytest.fixture()
def broken(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text(BROKEN)
    return path


def test_a_conforming_policy_passes_both_halves(capsys):
    assert (
        main(
            [
                "check",
                "fixed",
                "--param",
                "budget_tokens=16",
                "--examples",
                "10",
                "--serving-examples",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("checking policy 'fixed' (FixedBudgetPolicy); rules: valid-decision, ")
    assert "no-crash, serves\n" in out
    assert "per-boundary rules on 10 random boundaries ... ok (" in out
    assert "serves on 4 random workloads in the simulator ... ok (" in out
    assert out.endswith("policy 'fixed' passes every rule checked\n")


def test_a_broken_rule_fails_the_check_with_the_smallest_example(capsys, broken):
    assert main(["check", f"{broken}:StringlyTyped", "--examples", "20"]) == 1
    out = capsys.readouterr().out
    assert "per-boundary rules on 20 random boundaries ... FAILED\n" in out
    assert "[valid-decision] decide() returns a growpage.Decision: got 'compress'" in out
    assert "example: BoundaryCase(" in out and "num_pages=3" in out  # shrunk to the edge
    assert "serves on" not in out  # stopped at the first broken rule
    assert "passes" not in out
    assert "raised at" not in out  # no crash, no line of the policy's code to show


def test_a_crash_names_the_line_of_the_policy_that_raised(capsys, broken):
    assert main(["check", f"{broken}:AsksForAViewThatIsNot", "--examples", "5"]) == 1
    out = capsys.readouterr().out
    assert "[no-crash]" in out and "decide(ctx) raised ConfigError: " in out
    line = next(i for i, text in enumerate(BROKEN.splitlines(), 1) if '"longterm").sum()' in text)
    assert f"\n  raised at {broken}:{line}, in decide\n" in out  # not growpage's own frame


def test_what_only_a_served_workload_shows_fails_the_serving_half(capsys, broken):
    argv = [
        "check",
        f"{broken}:CrashesOnTheThirdRequest",
        "--examples",
        "10",
        "--serving-examples",
        "30",
    ]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "per-boundary rules on 10 random boundaries ... ok (" in out
    assert "serves on 30 random workloads in the simulator ... FAILED" in out
    assert "[serves]" in out and "RuntimeError: boom" in out and "requests=[r0:" in out
    boom = BROKEN.splitlines().index('            raise RuntimeError("boom")') + 1
    assert f"\n  raised at {broken}:{boom}, in decide\n" in out  # the policy's own line
    assert main([*argv, "--no-serving"]) == 0
    out = capsys.readouterr().out
    assert "rules: valid-decision" in out and ", serves" not in out
    assert out.endswith("passes every rule checked (serving rule skipped)\n")


@pytest.mark.parametrize(
    "argv, says",
    [
        (["check", "nope"], "unknown policy 'nope'"),
        (["check", "fixed", "--param", "budget_tokens=0"], "budget_tokens must be a positive"),
        (["check", "fixed", "--param", "budget"], "--param expects KEY=VALUE"),
    ],
)
def test_a_policy_that_cannot_be_built_is_a_usage_error(capsys, argv, says):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("growpage: error: ") and says in err


def test_a_bad_example_count_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as info:
        main(["check", "fixed", "--examples", "0"])
    assert info.value.code == 2
    assert "--examples: expected an integer >= 1, got 0" in capsys.readouterr().err


def test_the_check_runs_on_one_torch_thread_unless_told(monkeypatch, capsys):
    import torch

    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    assert main(["check", "fullkv", "--examples", "2", "--no-serving"]) == 0
    assert main(["check", "fullkv", "--examples", "2", "--no-serving", "--threads", "2"]) == 0
    assert threads == [1, 2]


SIBLING = textwrap.dedent("""
    import attrs
    from growpage_check_sibling import TAU   # a module beside this file
    from growpage.policies import GrowPagePolicy


    @attrs.define
    class UsesItsSibling(GrowPagePolicy):
        name = "uses-its-sibling"
        tau: float = TAU


    class PicksAMode(GrowPagePolicy):
        name = "picks-a-mode"

        def __init__(self, mode="a"):
            super().__init__()
            self.level = {"a": 1}[mode]
""")


def test_a_policy_file_imports_its_neighbours_and_a_failing_constructor_is_a_usage_error(
    tmp_path, capsys, monkeypatch
):
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))  # loading the file extends it
    (tmp_path / "growpage_check_sibling.py").write_text("TAU = 0.02\n")
    (tmp_path / "sibling_policy.py").write_text(SIBLING)
    spec = f"{tmp_path / 'sibling_policy.py'}"
    assert main(["check", f"{spec}:UsesItsSibling", "--examples", "3", "--no-serving"]) == 0
    assert "passes every rule checked" in capsys.readouterr().out
    # a constructor's own exception: the policy cannot be built (2), not a broken rule (1)
    assert main(["check", f"{spec}:PicksAMode", "--param", "mode=b"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "growpage: error: cannot build policy 'picks-a-mode': KeyError: 'b' "
        f"({tmp_path / 'sibling_policy.py'}:18, in __init__)\n"
    )  # the file's line


MOODY = textwrap.dedent("""
    from growpage import CapacityPolicy, Decision


    class ReadsDeltaWhenCrowded(CapacityPolicy):
        '''Right in every world, but which signals it reads depends on the pool.'''

        name = "crowded"

        def decide(self, ctx):
            if ctx.num_free_pages < 2 and ctx.delta() > 0:
                return Decision.GROW
            return Decision.GROW if ctx.num_pages < 3 else Decision.COMPRESS
""")


def test_a_policy_script_mode_cannot_serve_passes_with_a_note(capsys, tmp_path):
    """Not a broken rule (trace mode serves it), but the default of ``sim serve`` would stop on
    it: the check says so after passing, exit status 0."""
    path = tmp_path / "moody.py"
    path.write_text(MOODY)
    assert (
        main(
            ["check", f"{path}:ReadsDeltaWhenCrowded", "--examples", "5", "--serving-examples", "5"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "passes every rule checked\nnote: script mode (the default of `growpage sim serve`) "
        "cannot serve it: SimulationError: policy 'crowded' read delta()" in out
    )


def test_a_crash_in_select_names_the_line_of_the_policy_that_raised(capsys, broken):
    """As the other commands do for a policy error (until 2026-12 `check` printed only the
    message: the author had to rerun it in Python to find the line)."""
    assert (
        main(["check", f"{broken}:SelectIndexesPastItsBuffer", "--examples", "5", "--no-serving"])
        == 1
    )
    out = capsys.readouterr().out
    assert "[no-crash]" in out and "IndexError" in out
    line = next(
        i
        for i, text in enumerate(BROKEN.splitlines(), 1)
        if text.strip() == "return [0, 1, 2][keep]"
    )
    assert f"\n  raised at {broken}:{line}, in select\n" in out


LOCKED = textwrap.dedent("""
    import threading

    from growpage.policies import GrowPagePolicy


    class GuardedGrowPage(GrowPagePolicy):
        name = "guarded"

        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()

        def decide(self, ctx):
            with self.lock:
                return super().decide(ctx)
""")


def test_what_the_kit_could_not_check_is_noted_after_a_pass(capsys, tmp_path):
    path = tmp_path / "locked.py"
    path.write_text(LOCKED)
    assert (
        main(["check", f"{path}:GuardedGrowPage", "--examples", "4", "--serving-examples", "3"])
        == 0
    )
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[-3] == "policy 'guarded' passes every rule checked"
    assert lines[-2].startswith("note: policy 'guarded' cannot be deep-copied (TypeError: ")
    assert "'deterministic' was not checked on fresh copies of it" in lines[-2]
    assert lines[-1].startswith("note: policy 'guarded' cannot be deep-copied (TypeError: ")
    assert "'serves' ran the policy object itself twice" in lines[-1]


LONG = textwrap.dedent("""
    from growpage import CapacityPolicy, Decision


    class BreaksPast200Tokens(CapacityPolicy):
        '''Fine until its request passes position 200.'''

        name = "breaks-past-200"

        def decide(self, ctx):
            if ctx.position > 200:
                raise IndexError("ran off the end of a 200-entry table")
            return Decision.GROW if ctx.num_pages < 4 else Decision.COMPRESS
""")


def test_longer_contexts_and_requests_on_request(capsys, tmp_path, monkeypatch):
    """The defaults' contexts (6 pages of at most 16 tokens) and requests (40 + 120 tokens)
    never reach position 200 (160 at most); the knobs do, in each half."""
    path = tmp_path / "long.py"
    path.write_text(LONG)
    policy = f"{path}:BreaksPast200Tokens"
    assert main(["check", policy, "--examples", "20", "--serving-examples", "10"]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "check",
                policy,
                "--examples",
                "40",
                "--max-pages",
                "16",
                "--page-sizes",
                "16,32",
                "--no-serving",
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "[no-crash]" in out and "IndexError: ran off the end" in out
    assert "page_size=16" in out or "page_size=32" in out  # the sizes asked for
    # The serving half gets the knobs (serving_cases honours them: test_serving_check.py). A
    # real failing run costs half a minute, most of it hypothesis shrinking long workloads.
    import growpage.testing as kit

    served = []
    monkeypatch.setattr(kit, "check_serving", lambda policy, **kw: served.append(kw))
    assert (
        main(
            [
                "check",
                policy,
                "--examples",
                "2",
                "--serving-examples",
                "20",
                "--page-sizes",
                "8,16",
                "--max-output",
                "400",
            ]
        )
        == 0
    )
    assert served == [{"max_examples": 20, "page_sizes": (8, 16), "max_output": 400}]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--max-pages", "1"], "--max-pages: expected an integer >= 2, got 1"),
        (["--page-sizes", "1,4"], "--page-sizes: expected page sizes >= 2, got '1,4'"),
        (["--page-sizes", "four"], "--page-sizes: expected whole numbers >= 1"),
        (["--max-output", "0"], "--max-output: expected an integer >= 1, got 0"),
    ],
)
def test_bad_knobs_are_usage_errors(capsys, argv, says):
    with pytest.raises(SystemExit) as info:
        main(["check", "fixed", *argv])
    assert info.value.code == 2
    assert says in capsys.readouterr().err
