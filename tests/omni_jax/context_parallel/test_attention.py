"""`omni_jax.attention(..., context_axis=...)` against the single-device call.

Two devices run here (tests/conftest.py); four and eight run in a process of their own
(`tests.omni_jax.context_parallel.checks`), in float64. The kernels cannot run under the
Pallas interpreters inside a shard_map: here they are lowered for CUDA, and the test
marked ``gpu`` runs them on two GPUs.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import omni_jax
from tests.jax_releases import skip_unless_triton_lowers_here
from tests.omni_jax.context_parallel import checks
from tests.reference import relative_error

KERNELS = ("triton", "mosaic")
CUSTOM_CALLS = {"triton": "xla.gpu.triton", "mosaic": "mosaic_gpu"}


def _needs(num_devices: int) -> None:
    if len(jax.devices()) < num_devices:
        pytest.skip(f"needs {num_devices} devices")


@pytest.mark.parametrize(("case", "strategy", "layout"), checks.runs(half=0))
def test_two_devices_match_one(case, strategy, layout, seed):
    _needs(2)
    errors = checks.compare(case, 2, strategy, layout, seed=seed)
    assert max(errors.values()) < 2e-5, errors


@pytest.mark.parametrize(("num_devices", "half"), [(4, 1), (8, 0)])
def test_more_devices_match_one_in_float64(num_devices, half, seed):
    """Each count runs one case per strategy and layout; the two counts together run every
    combination (`checks.runs`)."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={num_devices}"}
    args = [str(num_devices), str(seed), "1e-10", str(half)]
    result = subprocess.run([sys.executable, "-m", "tests.omni_jax.context_parallel.checks",
                             *args], env=env, capture_output=True, text=True, timeout=600,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                                os.path.dirname(os.path.abspath(__file__))))))
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]


def test_odd_shard_length_contiguous(seed):
    """Seven positions per device: the contiguous layout takes any length."""
    _needs(2)
    errors = checks.compare("causal_documents", 2, "ring", "contiguous", seed=seed,
                            shard_len=7)
    assert max(errors.values()) < 2e-5, errors


def _call_on_two_devices(**kwargs):
    _needs(2)
    mesh = jax.make_mesh((2,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    x = jnp.ones((1, 2 * 7, 2, 8), jnp.float32)
    fn = jax.shard_map(lambda q: omni_jax.attention(q, q, q, implementation="xla", **kwargs),
                       mesh=mesh, in_specs=P(None, "seq"), out_specs=P(None, "seq"))
    return jax.jit(fn)(x)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"context_axis": "sequence"}, ValueError, "context_axis='sequence' is not an axis"),
    ({"context_axis": "seq", "context_layout": "zigzag"}, ValueError,
     "local sequence length must be even, got 7"),
    ({"context_axis": "seq", "context_strategy": "tree"}, ValueError,
     "context_strategy must be None or one of"),
    ({"context_axis": "seq", "context_layout": "striped"}, ValueError,
     "context_layout must be one of"),
    ({"context_axis": "seq", "score_mod": lambda s, b, h, i, j: s}, NotImplementedError,
     "does not take score_mod"),
], ids=["unknown_axis", "odd_zigzag", "strategy", "layout", "score_mod"])
def test_bad_arguments_raise_at_trace_time(kwargs, error, message):
    with pytest.raises(error, match=message):
        _call_on_two_devices(**kwargs)


def test_outside_shard_map_names_the_axis():
    x = jnp.ones((1, 8, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match="context_axis='seq' is not an axis"):
        omni_jax.attention(x, x, x, context_axis="seq")


@pytest.mark.parametrize("strategy", checks.STRATEGIES)
@pytest.mark.parametrize("implementation", KERNELS)
def test_kernels_lower_for_cuda(implementation, strategy, compiled_kernels):
    """Each step's forward and backward kernels lower as on a GPU under the shard_map."""
    if implementation == "triton":
        skip_unless_triton_lowers_here()
    _needs(2)
    mesh = jax.make_mesh((2,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])

    def grad(q, k, v):
        loss = lambda q, k, v: omni_jax.attention(
            q, k, v, is_causal=True, implementation=implementation, context_axis="seq",
            context_strategy=strategy, context_layout="zigzag").astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    seq = P(None, "seq")
    fn = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=(seq,) * 3, out_specs=(seq,) * 3))
    q = jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.bfloat16)
    text = fn.trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(CUSTOM_CALLS[implementation]) >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("layout", checks.LAYOUTS)
@pytest.mark.parametrize("strategy", checks.STRATEGIES)
@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("case", list(checks.CASES))
def test_kernels_on_two_gpus(case, implementation, strategy, layout, seed):
    """The kernels per step on two GPUs against the same kernels on one."""
    from pallas_kernels import runtime

    if jax.default_backend() != "gpu" or len(jax.devices()) < 2:
        pytest.skip("needs two CUDA GPUs")
    if implementation == "mosaic" and not runtime.can_run_mosaic_hopper():
        pytest.skip("needs sm90 GPUs")
    errors = checks.compare(case, 2, strategy, layout, dtype=jnp.bfloat16,
                            implementation=implementation, seed=seed, shard_len=256,
                            head_dim=64)
    # The same kernels on the same data, merged in another order: bf16 roundings only.
    assert max(errors.values()) < 2e-2, errors


def test_explicit_sequence_sharding_under_jit(seed):
    """No shard_map: arrays typed as sharded along an Explicit "seq" axis (and the batch
    along none), differentiated under a plain jit; results keep the sequence sharding."""
    _needs(2)
    (q, k, v, sinks, ids), kwargs = checks._inputs("causal_documents", 2, jnp.float32, seed,
                                                   checks.SHARD_LEN, 2)
    loss = lambda q, k, v, sinks, ids, **context: (omni_jax.attention(
        q, k, v, sinks=sinks, implementation="xla", **ids, **kwargs, **context) ** 2).sum()
    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    want = jax.jit(grad)(q, k, v, sinks, ids)
    mesh = jax.make_mesh((2,), ("seq",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        sequence = jax.sharding.NamedSharding(mesh, P(None, "seq"))
        q, k, v, ids = jax.device_put((q, k, v, ids), sequence)
        got = jax.jit(functools.partial(grad, context_axis="seq"))(q, k, v, sinks, ids)
    assert jax.typeof(got[0]).sharding.spec[1] == "seq"
    for g, w in zip(got, want, strict=True):
        assert relative_error(g, w) < 1e-5
