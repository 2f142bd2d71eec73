"""Mistakes a policy author makes, told by name: the policy's own class, the spec, the row."""

import textwrap

import attrs
import pytest

from growpage import CapacityPolicy, Decision, GrowPageConfig
from growpage.cli import main
from growpage.errors import ConfigError, PolicyError, describe_error
from growpage.eval.rows import parse_row
from growpage.policies import resolve_policy
from growpage.sim import replay_trace
from growpage.sim.synthetic import SyntheticSpec, synthetic_trace

POLICIES = textwrap.dedent("""
    from growpage import CapacityPolicy, Decision


    class _Base(CapacityPolicy):
        def decide(self, ctx):
            return Decision.COMPRESS


    class ReturnsAString(_Base):
        def decide(self, ctx):
            return "grow"


    class Raises(_Base):
        def decide(self, ctx):
            raise RuntimeError("boom")


    class NotAPolicy:
        def decide(self, ctx):
            return Decision.GROW


    not_a_class = 3
""")


pytestmark = pytest.mark.usefixtures("restore_registry")


@pytest.fixture
def policies(tmp_path):
    path = tmp_path / "author_policies.py"
    path.write_text(POLICIES)
    return path


class _Helper(CapacityPolicy):  # no name: named by its class
    def decide(self, ctx):
        return "grow"


class Child(_Helper):
    pass


@attrs.define
class AttrsChild(_Helper):
    share: float = 0.5


class Named(_Helper):
    name = "named"


class NamedChild(Named):
    pass


def test_a_subclass_of_an_unnamed_base_is_named_by_its_own_class():
    assert (_Helper.name, Child.name, AttrsChild.name, AttrsChild().name) == (
        "_Helper",
        "Child",
        "AttrsChild",
        "AttrsChild",
    )
    assert (Named.name, NamedChild.name) == ("named", "named")  # a written name is inherited


def test_the_controller_names_the_subclass_that_failed():
    trace = synthetic_trace(SyntheticSpec(gen_len=128), seed=0)
    with pytest.raises(PolicyError, match=r"^policy Child returned 'grow' from decide\(\)"):
        replay_trace(trace, Child(), GrowPageConfig(page_size=32))


def test_a_failed_constructor_names_the_subclass():
    class NeedsAnArgument(_Helper):
        def __init__(self, alpha):
            self.alpha = alpha

    with pytest.raises(PolicyError, match="cannot build policy 'NeedsAnArgument'"):
        resolve_policy(NeedsAnArgument)


def test_sim_replay_reports_a_wrong_return_value_as_serve_does(policies, capsys):
    """A failed trace gets the policy's line when its code raised, and no line of growpage's
    own when it returned a wrong value (``sim serve`` and ``generate`` add none either)."""
    args = ["--synthetic", "1", "--gen-len", "128", "--page-size", "32", "--fidelity-queries", "0"]
    assert main(["sim", "replay", *args, "--policy", f"{policies}:ReturnsAString"]) == 2
    err = capsys.readouterr().err
    assert "policy ReturnsAString returned 'grow' from decide()" in err
    assert "capacity.py" not in err and err.rstrip().endswith("at position 96)")
    assert main(["sim", "replay", *args, "--policy", f"{policies}:Raises"]) == 2
    err = capsys.readouterr().err
    assert "policy Raises decide() raised RuntimeError: boom" in err
    assert err.rstrip().endswith("author_policies.py:17, in decide)")


def test_an_error_that_is_not_a_policys_keeps_the_frame_that_raised_it():
    try:
        {}["missing"]
    except KeyError as exc:
        assert "test_author_mistakes.py" in describe_error(exc)


@pytest.mark.parametrize(
    "attr, says",
    [
        ("Nope", r"has no attribute 'Nope' \(its policy classes: ReturnsAString, Raises\)"),
        ("NotAPolicy", r"not a CapacityPolicy subclass \(a policy class subclasses growpage"),
        ("not_a_class", r"not a CapacityPolicy subclass \(got int; give a policy class"),
    ],
)
def test_a_spec_naming_no_policy_class_says_what_it_names(policies, attr, says):
    with pytest.raises(PolicyError, match=says):
        resolve_policy(f"{policies}:{attr}")


def test_an_instance_of_a_class_that_is_no_policy_is_refused_as_such():
    class Duck:
        def decide(self, ctx):
            return Decision.GROW

    with pytest.raises(PolicyError, match="a policy class subclasses growpage.CapacityPolicy"):
        resolve_policy(Duck())  # type: ignore[arg-type]


def test_an_eval_row_naming_no_policy_class_names_the_row(policies):
    row = f"mine={policies}:Nope:share=0.5"
    with pytest.raises(ConfigError, match=rf"^row '{row}': '.*' has no attribute 'Nope'"):
        parse_row(row)
