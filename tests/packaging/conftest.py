"""Starts the wheel build of tests/packaging/test_wheel.py once collection has found one of its
tests, so that it runs beside the tests before them (:mod:`wheel_helpers`)."""

from __future__ import annotations

import pytest
import wheel_helpers


def pytest_collection_finish(session: pytest.Session) -> None:
    if any(item.path.name == "test_wheel.py" for item in session.items):
        wheel_helpers.start(session.config)


def pytest_sessionfinish(session: pytest.Session) -> None:
    wheel_helpers.stop(session.config)
