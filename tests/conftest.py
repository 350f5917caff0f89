"""Test-wide setup: two virtual CPU devices so sharding tests run on any machine."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")


def pytest_generate_tests(metafunc):
    """Parametrizes `AttentionSuite` subclasses from their class attributes."""
    from tests.omni_jax.attention_suite import AttentionSuite, case_id, suite_parameters

    cls = metafunc.cls
    if cls is None or not issubclass(cls, AttentionSuite):
        return
    for name, values in suite_parameters(cls).items():
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, values, ids=case_id)
