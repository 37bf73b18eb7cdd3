"""Fixtures for the pool tests."""

from pool.drivers import driver_factory  # noqa: F401  (fixture)
