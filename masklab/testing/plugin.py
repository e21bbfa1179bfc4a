"""pytest plugin: fixtures that run SDP property checks, and the ``--sdp-max-examples`` option.

Registered as the ``masklab`` entry point of ``pytest11`` (or load it with
``-p masklab.testing.plugin``). Fixtures:

- ``sdp_max_examples``: the value of ``--sdp-max-examples`` (default 25).
- ``sdp_settings``: ``hypothesis.settings`` with that many examples and no deadline.
- ``sdp_check``: ``sdp_check(strategy, check)`` runs ``check(example)`` on examples drawn from
  ``strategy`` under ``sdp_settings``; Hypothesis shrinks and reports a failing example.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # hypothesis is a test dependency: the plugin loads without it
    from hypothesis import settings
    from hypothesis import strategies as st

DEFAULT_MAX_EXAMPLES = 25


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("masklab", "SDP property checks (masklab.testing)")
    group.addoption(
        "--sdp-max-examples",
        type=int,
        default=DEFAULT_MAX_EXAMPLES,
        help=f"examples per property run through the sdp_check fixture (default {DEFAULT_MAX_EXAMPLES})",
    )


def pytest_configure(config: pytest.Config) -> None:
    value = config.getoption("--sdp-max-examples")
    if value < 1:
        raise pytest.UsageError(f"--sdp-max-examples={value} must be >= 1")


@pytest.fixture
def sdp_max_examples(request: pytest.FixtureRequest) -> int:
    """The ``--sdp-max-examples`` value (checked to be >= 1 when pytest starts)."""
    return request.config.getoption("--sdp-max-examples")


@pytest.fixture
def sdp_settings(sdp_max_examples: int) -> settings:
    """Hypothesis settings for SDP property checks: ``--sdp-max-examples`` examples, no deadline."""
    from hypothesis import settings

    return settings(max_examples=sdp_max_examples, deadline=None)


@pytest.fixture
def sdp_check(sdp_settings: settings) -> Callable[[st.SearchStrategy[Any], Callable[[Any], None]], None]:
    """``sdp_check(strategy, check)``: run ``check`` as a Hypothesis property over ``strategy``."""

    from hypothesis import given

    def run(strategy: st.SearchStrategy[Any], check: Callable[[Any], None]) -> None:
        sdp_settings(given(strategy)(check))()

    return run
