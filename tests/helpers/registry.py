"""Test-only layer types. Each is registered with cct's `register` by importing
the helpers module that defines it, which Python does once per process, so the
registry (which refuses a second registration) sees it once; test files never
register layers themselves. TEST_ONLY_TYPES tells them from cct's own types
(tests/layers/test_registry.py)."""
from cct.core.layer import register

TEST_ONLY_TYPES = set()


def register_test_layer(type_name):
    """cct's `register`, recording the type as test-only."""
    def add(cls):
        register(type_name)(cls)
        TEST_ONLY_TYPES.add(type_name)
        return cls
    return add
