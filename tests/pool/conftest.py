"""Fixtures for the pool tests."""

from tests.pool.drivers import driver_factory  # noqa: F401  (fixture)
