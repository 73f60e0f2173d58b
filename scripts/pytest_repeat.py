"""A pytest plugin for hunting flaky tests: ``--count N`` runs every collected test N times (as
the pytest-repeat package does, which the project does not depend on). Loaded by
scripts/flake_hunt.sh with ``-p pytest_repeat``."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--count", type=int, default=1, help="run each test this many times")


@pytest.fixture
def _repetition(request: pytest.FixtureRequest) -> int:
    return request.param


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    count = metafunc.config.getoption("count")
    if count > 1:  # a parameter of its own: each run gets fresh fixtures and its own node id ([0], [1], ...)
        metafunc.fixturenames.append("_repetition")
        metafunc.parametrize("_repetition", range(count), indirect=True)
