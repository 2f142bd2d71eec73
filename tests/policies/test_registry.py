"""Resolving policies from files and modules: repeatable, isolated, and clear when it fails."""

import sys
import textwrap

import pytest

from growpage.errors import PolicyError
from growpage.policies import registered_policies, resolve_policy

pytestmark = pytest.mark.usefixtures("restore_registry")


REGISTERING = textwrap.dedent("""
    import attrs
    from growpage import CapacityPolicy, Decision
    from growpage.policies import register_policy

    @register_policy
    @attrs.define
    class Mine(CapacityPolicy):
        name = "{name}"
        share: float = 0.5

        def decide(self, ctx):
            return Decision.{decision}
""")


def write(path, name="file-registered", decision="COMPRESS"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(REGISTERING.format(name=name, decision=decision))
    return f"{path}:Mine"


def test_a_file_policy_resolves_again(tmp_path):
    """``growpage sim replay`` resolves the policy once per trace: the second time must not
    run the file again (its ``@register_policy`` then clashed with its own first class)."""
    spec = write(tmp_path / "mine.py")
    first, second = resolve_policy(spec), resolve_policy(spec, share=0.25)
    assert type(first) is type(second) and second.share == 0.25
    assert registered_policies()["file-registered"] is type(first)


def test_a_symlinked_policy_file_resolves(tmp_path):
    """The file is run from its resolved path, which need not end in .py (importlib then found
    no loader, and resolving raised AttributeError)."""
    target = tmp_path / "store" / "mine.policy"
    write(target, "symlinked")
    link = tmp_path / "mine.py"
    link.symlink_to(target)
    policy = resolve_policy(f"{link}:Mine")
    assert policy.name == "symlinked" and registered_policies()["symlinked"] is type(policy)


def test_files_with_the_same_name_stay_apart(tmp_path):
    a = resolve_policy(write(tmp_path / "a" / "policy.py", "same-stem-a", "GROW"))
    b = resolve_policy(write(tmp_path / "b" / "policy.py", "same-stem-b", "SHRINK"))
    assert (a.name, b.name) == ("same-stem-a", "same-stem-b")
    assert a.decide(None).value == "grow" and b.decide(None).value == "shrink"
    assert type(a).__module__ != type(b).__module__


@pytest.mark.parametrize(
    "source, says",
    [
        ("def (:\n", "SyntaxError"),
        ("import no_such_module_for_growpage_tests\n", "ModuleNotFoundError"),
        ("raise RuntimeError('setup failed')\n", "RuntimeError: setup failed"),
        ("import sys\nsys.exit(3)\n", r"it exited at import \(SystemExit\(3\)\)"),
        (
            "import argparse\nargparse.ArgumentParser().parse_args(['--nope'])\n",
            r"exited at import \(SystemExit\(2\)\); run a script's main only under",
        ),
    ],
)
def test_a_file_that_fails_to_load_is_a_policy_error(tmp_path, source, says):
    path = tmp_path / "broken_policy.py"
    path.write_text(source)
    before = set(sys.modules)
    with pytest.raises(PolicyError, match=f"cannot load policy file .*broken_policy.py.*{says}"):
        resolve_policy(f"{path}:Mine")
    assert set(sys.modules) == before  # no half-run module left behind


def test_a_module_that_exits_at_import_is_a_policy_error(tmp_path, monkeypatch):
    (tmp_path / "exiting_policy_module.py").write_text("raise SystemExit('bye')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PolicyError, match=r"cannot import policy module .*exited at import"):
        resolve_policy("exiting_policy_module:Mine")


def test_a_file_fixed_after_a_failed_load_resolves(tmp_path):
    path = tmp_path / "half.py"
    path.write_text(REGISTERING.format(name="half-loaded", decision="GROW") + "1 / 0\n")
    with pytest.raises(PolicyError, match="ZeroDivisionError"):
        resolve_policy(f"{path}:Mine")
    # The failed run had registered its class; the fixed file replaces it.
    assert resolve_policy(write(path, "half-loaded")).decide(None).value == "compress"


@pytest.mark.parametrize(
    "spec, says",
    [
        (":Mine", "package.module:ClassName"),
        ("growpage.policies:", "package.module:ClassName"),
    ],
)
def test_a_malformed_spec_is_a_policy_error(spec, says):
    with pytest.raises(PolicyError, match=says):
        resolve_policy(spec)


def test_a_module_that_fails_on_import_is_a_policy_error(tmp_path, monkeypatch):
    (tmp_path / "failing_policy_module.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        PolicyError,
        match="cannot import policy module 'failing_policy_module'.*RuntimeError: no GPU here",
    ):
        resolve_policy("failing_policy_module:Mine")


def test_a_hyperparameter_given_twice_on_the_command_line_is_refused():
    from growpage.errors import ConfigError
    from growpage.policies.registry import parse_policy_params

    assert parse_policy_params(["tau=0.1", "beta=2"]) == {"tau": 0.1, "beta": 2}
    with pytest.raises(ConfigError, match=r"--param tau given twice \('tau=0.1' and 'tau=0.2'\)"):
        parse_policy_params(["tau=0.1", "tau=0.2"])


def test_spaces_around_a_hyperparameter_name_are_ignored_as_around_its_value():
    from growpage.errors import ConfigError
    from growpage.policies.registry import parse_policy_params

    assert parse_policy_params([" budget_tokens = 1024 ", "tau =0.5"]) == {
        "budget_tokens": 1024,
        "tau": 0.5,
    }
    with pytest.raises(ConfigError, match="--param tau given twice"):
        parse_policy_params(["tau=0.1", " tau=0.2"])
    with pytest.raises(ConfigError, match="--param expects KEY=VALUE, got ' = 3'"):
        parse_policy_params([" = 3"])


def test_a_policy_without_a_usable_name_is_refused_and_the_registry_kept():
    """``name: str = "x"`` in an attrs class is a field: the class has no string name. Refused
    at registration, naming the cause, and the registry still lists and resolves."""
    import attrs

    from growpage import CapacityPolicy, Decision
    from growpage.policies import register_policy

    @attrs.define
    class AnnotatedName(CapacityPolicy):
        name: str = "annotated"

        def decide(self, ctx):
            return Decision.GROW

    @attrs.define
    class WithColon(CapacityPolicy):
        name = "pkg:mine"  # would read as an import spec

        def decide(self, ctx):
            return Decision.GROW

    before = registered_policies()
    with pytest.raises(
        PolicyError,
        match=r"AnnotatedName has no usable name.*without the "
        "annotation",
    ):
        register_policy(AnnotatedName)
    with pytest.raises(
        PolicyError, match=r"WithColon has no usable name to register: name is 'pkg:mine'"
    ):
        register_policy(WithColon)
    with pytest.raises(PolicyError, match="takes a CapacityPolicy subclass"):
        register_policy(dict)
    assert registered_policies() == before
    assert resolve_policy("growpage").name == "growpage"


def test_an_unknown_hyperparameter_lists_the_policy_s_own():
    with pytest.raises(
        PolicyError,
        match=r"unexpected keyword argument 'budget'.* \(its "
        r"hyperparameters: budget_tokens\)$",
    ):
        resolve_policy("fixed", budget=512)
    with pytest.raises(PolicyError, match=r"hyperparameters: none\)$"):
        resolve_policy("fullkv", tau=0.1)
    with pytest.raises(PolicyError, match=r"budget_tokens must be a positive integer, got 0$"):
        resolve_policy("fixed", budget_tokens=0)  # a known one out of range: no list
