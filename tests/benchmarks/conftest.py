"""Fixtures for the benchmark tests."""

import pytest


@pytest.fixture
def timed_together(monkeypatch):
    """``timed_together(module)`` -> the list of name lists that ``module`` hands to each
    `bench_interleaved` call (the implementations it times together), filled as it runs."""

    def install(module) -> list[list[str]]:
        groups: list[list[str]] = []
        real = module.bench_interleaved

        def spy(fns, arg_sets, **kwargs):
            groups.append(list(fns))
            return real(fns, arg_sets, **kwargs)

        monkeypatch.setattr(module, "bench_interleaved", spy)
        return groups

    return install
