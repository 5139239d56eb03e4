"""The suite's own scheduling (pyproject.toml, tests/conftest.py): under --dist loadgroup a test marked
xdist_group("name") carries "@name" in its node id, by which pytest-xdist deals the group to one worker, so that a
group's module-scoped fixture (a distributed child, a static check's compiles) is made once per run."""

from __future__ import annotations

import pytest


@pytest.mark.xdist_group("suite_scheduling")
def test_a_grouped_test_is_dealt_by_its_group(request: pytest.FixtureRequest) -> None:
    if getattr(request.config.option, "loadgroup", False) is not True:
        pytest.skip("not run by a pytest-xdist worker under --dist loadgroup")
    assert request.node.nodeid.endswith("::test_a_grouped_test_is_dealt_by_its_group@suite_scheduling")
