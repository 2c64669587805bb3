"""The shared package's fixtures: a redis-server of a module's own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from infra.redis_server import RedisServer
from tests.conftest import own_redis


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of the module's own: what the module counts or creates there (command counts, users) is its
    alone, where the session's serves live stacks."""
    yield from own_redis(tmp_path_factory, "module-redis")
