"""A real redis-server on a free loopback port, started and stopped by the tests (by pid); the two
emulated hosts are in tests/conftest.py."""

import shutil

import pytest

from megascale.stores.redis_store import local_redis_server


@pytest.fixture(scope="session")
def redis_url():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it: apt-get install redis-server)")
    with local_redis_server(timeout_s=20) as url:
        yield url
