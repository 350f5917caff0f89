"""Forcing and watching the configs and plans a test's calls trace with (the backends
look their configs up and call their kernels while tracing, so a patched look-up reaches
the kernels and a patched kernel sees each config)."""

import dataclasses
import importlib
from typing import Any


def force_config_fields(monkeypatch, module: Any, lookup: str, **fields: Any) -> None:
    """Makes ``module.lookup`` return its default config with ``fields`` replaced."""
    default = getattr(module, lookup)
    monkeypatch.setattr(module, lookup, lambda *args, **kwargs: dataclasses.replace(
        default(*args, **kwargs), **fields))


def record_configs(monkeypatch, module: Any, kernel: str) -> list:
    """The ``config`` keyword of every call of ``module.kernel`` from now on."""
    configs, real = [], getattr(module, kernel)

    def recording(*args, config, **kwargs):
        configs.append(config)
        return real(*args, config=config, **kwargs)

    monkeypatch.setattr(module, kernel, recording)
    return configs


def record_plans(monkeypatch) -> list:
    """Every `AttentionPlan` `omni_jax.attention` makes from now on."""
    module = importlib.import_module("omni_jax.attention")  # The package exports the function.
    plans, plan_attention = [], module.plan_attention

    def recording(implementation, problem, **kwargs):
        plans.append(plan_attention(implementation, problem, **kwargs))
        return plans[-1]

    monkeypatch.setattr(module, "plan_attention", recording)
    return plans
