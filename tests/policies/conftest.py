"""Policy test fixtures."""

from __future__ import annotations

import pytest

from growpage.policies import registry


@pytest.fixture
def restore_registry():
    """The policy registry as it was before the test: a test may register policies (a policy
    file's module registers its classes when it is imported). Use with
    ``pytestmark = pytest.mark.usefixtures("restore_registry")``."""
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)
