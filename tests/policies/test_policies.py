"""Built-in policies, the registry and the conformance kit."""

import copy
import pickle
import subprocess
import sys
import textwrap

import attrs
import pytest
import torch

import growpage
from growpage import (
    CapacityController,
    CapacityPolicy,
    Decision,
    GrowPageConfig,
    PagePool,
    RequestState,
)
from growpage.errors import ConfigError, PolicyError
from growpage.policies import (
    EntropyPolicy,
    FixedBudgetPolicy,
    FullKVPolicy,
    GrowPagePolicy,
    H2OPolicy,
    InversePolicy,
    RandomPolicy,
    ShrinkPolicy,
    SnapKVPolicy,
    StreamingLLMPolicy,
    registered_policies,
    resolve_policy,
)
from growpage.testing import BoundaryCase, PolicyConformanceError, check_policy, check_serving

BUILTINS = [
    GrowPagePolicy(),
    FixedBudgetPolicy(budget_tokens=32),
    FullKVPolicy(),
    RandomPolicy(grow_prob=0.5, seed=3),
    InversePolicy(),
    ShrinkPolicy(min_capacity_tokens=8),
    EntropyPolicy(),
    StreamingLLMPolicy(budget_tokens=32),
    H2OPolicy(budget_tokens=32),
    SnapKVPolicy(budget_tokens=32),
]


@pytest.mark.parametrize("policy", BUILTINS, ids=lambda p: p.name)
def test_builtin_policies_conform(policy):
    check_policy(policy, max_examples=25)


@pytest.mark.parametrize("policy", BUILTINS, ids=lambda p: p.name)
def test_a_subclass_s_own_attributes_survive_copies_and_pickles(policy):
    """An author subclasses a built-in and sets an attribute in __init__: every copy the kit
    makes (fresh copies per example) and every pickle (a sweep's worker) keeps it."""
    base = type(policy)

    def init(self, bias=0.25):
        base.__init__(self, **attrs.asdict(policy, recurse=False))
        self.bias = bias

    sub = type(f"Biased{base.__name__}", (base,), {"__init__": init, "__module__": __name__})
    globals()[sub.__name__] = sub  # picklable by reference, as a module-level class is
    try:
        made = sub(bias=0.5)
        for copied in (copy.deepcopy(made), copy.copy(made), pickle.loads(pickle.dumps(made))):
            assert copied.bias == 0.5
            assert attrs.asdict(copied, recurse=False) == attrs.asdict(made, recurse=False)
    finally:
        del globals()[sub.__name__]


def test_a_subclass_reading_its_own_attribute_passes_the_kit():
    class Biased(GrowPagePolicy):
        name = "biased"

        def __init__(self, bias: float = 0.0) -> None:
            super().__init__()
            self.bias = bias

        def decide(self, ctx):
            return Decision.GROW if ctx.delta(self.p) > self.bias else Decision.COMPRESS

    check_policy(Biased(0.1), max_examples=10)
    check_serving(Biased(0.1), max_examples=4)


def test_all_builtins_are_registered():
    names = set(registered_policies())
    assert {
        "growpage",
        "fixed",
        "fullkv",
        "random",
        "inverse",
        "shrink",
        "entropy",
        "streamingllm",
        "h2o",
        "snapkv",
    } <= names
    assert isinstance(resolve_policy("fixed", budget_tokens=512), FixedBudgetPolicy)


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(PolicyError, match="unknown policy 'nope'.*growpage"):
        resolve_policy("nope")
    with pytest.raises(PolicyError, match="cannot import"):
        resolve_policy("no_such_module_xyz:Policy")
    with pytest.raises(PolicyError, match="not a CapacityPolicy"):
        resolve_policy("growpage.core.pages:PagePool")


def test_invalid_hyperparameters_name_the_field():
    with pytest.raises(ConfigError, match="RandomPolicy.grow_prob"):
        RandomPolicy(grow_prob=1.5)
    with pytest.raises(PolicyError, match="FixedBudgetPolicy.budget_tokens"):
        resolve_policy("fixed", budget_tokens=0)


@pytest.mark.parametrize(
    "name, params, field",
    [
        ("growpage", {"tau": "abc"}, "GrowPagePolicy.tau"),  # --param tau=abc
        ("random", {"grow_prob": "high"}, "RandomPolicy.grow_prob"),
        ("growpage", {"p": True}, "GrowPagePolicy.p"),  # --param p=true
        ("fixed", {"budget_tokens": True}, "FixedBudgetPolicy.budget_tokens"),
        ("shrink", {"min_capacity_tokens": 1024.5}, "ShrinkPolicy.min_capacity_tokens"),
        ("random", {"seed": 1.5}, "RandomPolicy.seed"),  # --param seed=1.5
        ("random", {"seed": "a"}, "RandomPolicy.seed"),
        ("random", {"seed": True}, "RandomPolicy.seed"),
    ],
)
def test_wrongly_typed_hyperparameters_name_the_field(name, params, field):
    """A string or bool from ``--param`` is refused with the field's name, not a comparison
    error between float and str, nor taken as 1."""
    with pytest.raises(PolicyError, match=rf"{field} must .*got {params[field.split('.')[1]]!r}"):
        resolve_policy(name, **params)


def test_an_attrs_type_validator_s_error_reads_as_one_line():
    """attrs' ``instance_of`` raises TypeError(message, attribute, type, value): the message is
    shown, not the tuple."""
    import attrs

    @attrs.define
    class Typed(GrowPagePolicy):
        name = "typed-max-pages"
        max_pages: int = attrs.field(default=16, validator=attrs.validators.instance_of(int))

    with pytest.raises(PolicyError) as info:
        resolve_policy(Typed, max_pages=8.0)
    assert str(info.value) == (
        "cannot build policy 'typed-max-pages': 'max_pages' must be "
        "<class 'int'> (got 8.0 that is a <class 'float'>)."
    )


CASE = dict(
    num_layers=2,
    num_kv_heads=2,
    group_size=2,
    head_dim=8,
    page_size=8,
    recent_window=2,
    num_pages=4,
    num_free_pages=3,
    gap=4,
    seed=5,
    sharpness=1.0,
    track_accumulated=True,
)


def test_decision_logic_of_simple_policies():
    ctx = BoundaryCase(**CASE).context()  # capacity 32 tokens
    assert FixedBudgetPolicy(budget_tokens=40).decide(ctx) is Decision.GROW
    assert FixedBudgetPolicy(budget_tokens=32).decide(ctx) is Decision.COMPRESS
    assert FullKVPolicy().decide(ctx) is Decision.GROW
    d = ctx.delta()
    assert GrowPagePolicy(tau=d - 1e-3).decide(ctx) is Decision.GROW
    assert GrowPagePolicy(tau=d + 1e-3).decide(ctx) is Decision.COMPRESS
    assert InversePolicy(tau=d + 1e-3).decide(ctx) is Decision.GROW
    assert (
        ShrinkPolicy(shrink_below=d + 1e-3, tau=d + 2e-3, min_capacity_tokens=8).decide(ctx)
        is Decision.SHRINK
    )
    assert (
        ShrinkPolicy(shrink_below=d + 1e-3, tau=d + 2e-3, min_capacity_tokens=32).decide(ctx)
        is Decision.COMPRESS
    )
    assert EntropyPolicy(tau=ctx.entropy_delta() - 1e-3).decide(ctx) is Decision.GROW


def test_random_policy_grow_rate_and_reproducibility():
    ctxs = [BoundaryCase(**{**CASE, "gap": g}).context() for g in range(400)]
    policy = RandomPolicy(grow_prob=0.3, seed=1)
    first = [policy.decide(c) for c in ctxs]
    assert first == [policy.decide(c) for c in ctxs]
    rate = sum(d is Decision.GROW for d in first) / len(first)
    assert 0.22 < rate < 0.38
    assert first != [RandomPolicy(grow_prob=0.3, seed=2).decide(c) for c in ctxs]


def test_classic_selections():
    ctx = BoundaryCase(**CASE).context()
    keep = 24
    sl = StreamingLLMPolicy(num_sinks=4).select(ctx, keep)
    assert sl[0, 0].tolist() == [0, 1, 2, 3] + list(range(12, 32))
    h2o = H2OPolicy().select(ctx, keep)
    acc = ctx.accumulated_attention()[..., :30]
    top = acc.topk(keep - 2, dim=-1).indices.sort(-1).values
    assert torch.equal(h2o[..., :-2], top)


# ---- deliberately broken policies: the kit must name the rule ---------------------------
@attrs.define
class DropsOne(GrowPagePolicy):
    name = "drops-one"

    def select(self, ctx, keep):
        return super().select(ctx, keep)[..., :-1]


@attrs.define
class Duplicates(GrowPagePolicy):
    name = "duplicates"

    def select(self, ctx, keep):
        idx = super().select(ctx, keep)
        idx[..., 0] = idx[..., 1]
        return idx


@attrs.define
class DropsRecent(GrowPagePolicy):
    name = "drops-recent"

    def select(self, ctx, keep):
        return torch.arange(keep).expand(*ctx.shape, keep).clone()


@attrs.define
class ReturnsString(CapacityPolicy):
    name = "string"

    def decide(self, ctx):
        return "grow"


@attrs.define
class Mutates(GrowPagePolicy):
    name = "mutates"

    def decide(self, ctx):
        ctx.view.keys().mul_(2)
        return Decision.GROW


@attrs.define
class Flaky(CapacityPolicy):
    name = "flaky"
    calls: list = attrs.field(factory=list)

    def decide(self, ctx):
        self.calls.append(1)
        return Decision.GROW if len(self.calls) % 2 else Decision.COMPRESS


@pytest.mark.parametrize(
    "policy, rule, says",
    [
        (DropsOne(), "exact-selection", "wrong shape"),
        (Duplicates(), "exact-selection", "duplicate"),
        (DropsRecent(), "exact-selection", "recent window"),
        (ReturnsString(), "valid-decision", "'grow'"),
        (Mutates(), "no-mutation", "changed"),
        (Flaky(), "deterministic", "decided"),
    ],
    ids=lambda x: getattr(x, "name", None),
)
def test_check_policy_names_the_broken_rule(policy, rule, says):
    with pytest.raises(PolicyConformanceError) as info:
        check_policy(policy, max_examples=20)
    assert info.value.rule == rule and says in info.value.detail
    assert f"[{rule}]" in str(info.value) and "example: BoundaryCase(" in str(info.value)


EXTERNAL = textwrap.dedent('''
    import attrs
    from growpage import BoundaryContext, CapacityPolicy, Decision

    @attrs.define
    class HalfwayPolicy(CapacityPolicy):
        """Grow while the short working set covers more than ``share`` of the candidates."""
        name = "halfway"
        share: float = 0.5

        def decide(self, ctx: BoundaryContext) -> Decision:
            r = float(ctx.working_set_ratio("short").mean())
            return Decision.GROW if r > self.share else Decision.COMPRESS
''')


def test_policy_from_a_file_outside_the_repository(tmp_path):
    path = tmp_path / "my_policy.py"
    path.write_text(EXTERNAL)
    policy = resolve_policy(f"{path}:HalfwayPolicy", share=0.4)
    check_policy(policy, max_examples=15)
    # ... and it runs through the controller.
    case = BoundaryCase(**CASE)
    pool = PagePool(8, case.page_size)
    ctrl = CapacityController(policy, pool, GrowPageConfig(page_size=8, recent_window=2))
    state = RequestState("ext", pool.allocate(4), num_tokens=32, position=36)
    out = ctrl.on_boundary(state, case.view())
    assert out.decision in (Decision.GROW, Decision.COMPRESS)
    assert ctrl.events.boundaries == 1


def test_public_imports():
    from growpage import BoundaryContext, CapacityPolicy, Decision  # noqa: F401
    from growpage.testing import check_policy  # noqa: F401

    assert growpage.CapacityPolicy is CapacityPolicy


def test_cli_lists_policies():
    out = subprocess.run(
        [sys.executable, "-m", "growpage.cli", "policies"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in ("growpage", "fixed", "fullkv", "random", "inverse", "shrink", "entropy"):
        assert f"\n{name} " in "\n" + out
    help_out = subprocess.run(
        [sys.executable, "-m", "growpage.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "policies" in help_out


def test_policy_guide_example_runs(tmp_path):
    """The policy in docs/policy-guide.md is under 30 lines and passes the kit as written."""
    from pathlib import Path

    guide = (Path(__file__).parents[2] / "docs" / "policy-guide.md").read_text()
    code = guide.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) < 30
    path = tmp_path / "my_policy.py"
    path.write_text(code)
    check_policy(resolve_policy(f"{path}:CappedGrowPage", max_pages=3), max_examples=15)


def test_policy_guide_context_table_names_what_the_context_has():
    """Every name in the guide's "What the context offers" table is there on a context."""
    import re
    from pathlib import Path

    guide = (Path(__file__).parents[2] / "docs" / "policy-guide.md").read_text()
    table = guide.split("## What the context offers", 1)[1].split("\n\n", 2)[1]
    first_cells = [row.split(" | ")[0] for row in table.splitlines()[2:]]
    names = {name for cell in first_cells for name in re.findall(r"`([a-z_]+)", cell)}
    assert {"request_id", "delta", "scores", "positions"} <= names
    ctx = BoundaryCase(**CASE).context()
    assert sorted(name for name in names if not hasattr(ctx, name)) == []


def test_policy_guide_check_and_property_examples_run_as_written(tmp_path, monkeypatch):
    """The guide's policy saved as my_policy.py, then its "Check it" and property-test
    examples, run in the directory they assume."""
    from pathlib import Path

    guide = (Path(__file__).parents[2] / "docs" / "policy-guide.md").read_text()
    blocks = [part.split("```", 1)[0] for part in guide.split("```python\n")[1:]]

    def block(marker: str) -> str:
        found = [b for b in blocks if marker in b]
        assert len(found) == 1, marker
        return found[0]

    policy_code = blocks[0]
    check, serving = block("check_policy(policy)"), block("check_serving(policy)")
    prop = block("@given(boundary_contexts(")
    (tmp_path / "my_policy.py").write_text(policy_code)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(check + serving + prop, "docs/policy-guide.md", "exec"), scope)
    assert scope["policy"].max_pages == 8
    with pytest.raises(PolicyError, match="max_pages"):  # the validator the guide shows
        resolve_policy(f"{tmp_path}/my_policy.py:CappedGrowPage", max_pages="8")
