"""The public ops inside `jax.shard_map`, with its default check of varying mesh axes.

Inside a shard_map JAX types every array by the mesh axes along which it varies: kernel
results and loop carries must vary like the operands, and the gradients of replicated
operands (weights, sinks, the shared MLA latent) are summed over the devices. The
portable implementations run on two CPU devices here; the kernels are lowered for CUDA
and run on a GPU, and the Mosaic backward (its fused dQ, an operand aliased to a result)
runs interpreted on two CPU devices too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import omni_jax
from pallas_kernels import compat, runtime
from pallas_kernels.mosaic import attention_bwd_sm90
from tests.forced_configs import force_config_fields, record_plans
from tests.jax_releases import skip_unless_blackwell_interpreter, skip_unless_triton_lowers_here
from tests.mosaic_interpret import devices_share_the_interpreter, interpreted_mosaic
from tests.reference import dense_mask, reference_attention, relative_error

KERNELS = ("triton", "mosaic")


def _mesh(size: int = 2) -> jax.sharding.Mesh:
    if len(jax.devices()) < size:
        pytest.skip(f"needs {size} devices (tests/conftest.py asks XLA for two host devices)")
    return jax.make_mesh((size,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:size])


def _sharded(fn, mesh, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def _attention_grad(implementation: str, is_causal: bool = True):
    """(out, d q/k/v/sinks) of a loss on attention with ALiBi and sinks (and segment ids
    when given)."""
    slopes = jnp.asarray([0.5, 0.25], jnp.float32)  # captured: replicated

    def loss(q, k, v, sinks, *ids):
        out = omni_jax.attention(
            q, k, v, is_causal=is_causal, sinks=sinks, implementation=implementation,
            q_segment_ids=ids[0] if ids else None,
            score_mod=lambda s, b, h, i, j: s - slopes[h] * (i - j))
        return (out.astype(jnp.float32) ** 2).sum(), out

    def grad(*args):
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*args)
        return out, grads

    return grad


def _attention_inputs(rng, dtype, batch=4, seq=40, heads=2, head_dim=16):
    q, k, v = (jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)), dtype)
               for _ in range(3))
    sinks = jnp.asarray(rng.standard_normal(heads), jnp.float32)
    ids = jnp.asarray(np.sort(rng.integers(0, 3, (batch, seq)), axis=1), jnp.int32)
    return q, k, v, sinks, ids


def test_attention_matches_unsharded(seed):
    mesh = _mesh()
    args = _attention_inputs(np.random.default_rng(seed), jnp.float32)
    grad = _attention_grad("xla")
    batch = P("data")
    sharded = _sharded(grad, mesh, (batch, batch, batch, P(), batch),
                       (batch, (batch, batch, batch, P())))
    out, grads = sharded(*args)
    out_ref, grads_ref = jax.jit(grad)(*args)
    for got, want in zip((out, *grads), (out_ref, *grads_ref), strict=True):
        assert relative_error(got, want) < 1e-5


def test_attention_over_heads_with_a_sharded_capture(seed):
    """Heads sharded, GQA: each device gets its kv heads' q heads, sinks and the ALiBi
    slopes of its heads (a score_mod sees head indices within the shard)."""
    mesh = _mesh()
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((2, 40, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 40, 2, 16)), jnp.float32) for _ in range(2))
    sinks, slopes = (jnp.asarray(rng.uniform(0.1, 1.0, 4), jnp.float32) for _ in range(2))

    def grad(q, k, v, sinks, slopes):
        def loss(q, k, v, sinks, slopes):
            out = omni_jax.attention(q, k, v, is_causal=True, sinks=sinks, implementation="xla",
                                     score_mod=lambda s, b, h, i, j: s - slopes[h] * (i - j))
            return (out ** 2).sum()
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, sinks, slopes)

    heads = P(None, None, "data")
    specs = (heads, heads, heads, P("data"), P("data"))
    got = _sharded(grad, mesh, specs, specs)(q, k, v, sinks, slopes)
    for g, want in zip(got, jax.jit(grad)(q, k, v, sinks, slopes), strict=True):
        assert relative_error(g, want) < 1e-5


def test_score_mod_with_jitted_and_custom_jvp_functions(seed):
    """A score_mod's jaxpr holds calls (``jnp.where`` is jitted) and custom_jvp functions
    (relu, softplus): evaluated on varying operands, with a replicated capture."""
    mesh = _mesh()
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((4, 32, 2, 16)), jnp.float32) for _ in range(3))
    bias = jnp.asarray(rng.standard_normal(2), jnp.float32)

    def loss(q, k, v, bias):
        def score_mod(s, b, h, i, j):
            return jnp.where(i >= j, jax.nn.softplus(s) + jax.nn.relu(s) * bias[h], s / 2)
        return (omni_jax.attention(q, k, v, score_mod=score_mod, implementation="xla") ** 2).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))

    batch = P("data")
    specs = (batch, batch, batch, P())
    got = _sharded(grad, mesh, specs, specs)(q, k, v, bias)
    for g, want in zip(got, jax.jit(grad)(q, k, v, bias), strict=True):
        assert relative_error(g, want) < 1e-5


def test_matmul_matches_unsharded(seed):
    mesh = _mesh()
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((48, 40)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(40), jnp.float32)

    def grad(a, w, bias):  # rows of `a` sharded; the weight and bias replicated
        loss = lambda *x: (omni_jax.matmul(*x[:2], bias=x[2], activation="gelu",
                                           implementation="xla") ** 2).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(a, w, bias)

    got = _sharded(grad, mesh, (P("data"), P(), P()), (P("data"), P(), P()))(a, w, bias)
    for g, want in zip(got, jax.jit(grad)(a, w, bias), strict=True):
        assert relative_error(g, want) < 1e-5


def test_sparse_mla_matches_unsharded(seed):
    mesh = _mesh()
    rng = np.random.default_rng(seed)
    s_q, s_kv, heads, d_qk, d_v, topk = 8, 24, 4, 32, 16, 8
    q = jnp.asarray(rng.standard_normal((s_q, heads, d_qk)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((s_kv, 1, d_qk)), jnp.float32)
    indices = jnp.asarray(rng.integers(-2, s_kv + 2, (s_q, 1, topk)), jnp.int32)

    def grad(q, kv, indices):  # query rows sharded; the latent kv replicated
        def loss(q, kv):
            out, _, lse, scores = omni_jax.sparse_mla_prefill(
                q, kv, indices, sm_scale=0.2, d_v=d_v, return_scores=True,
                implementation="xla")
            finite = jnp.where(jnp.isfinite(scores), scores, 0.0)
            return (out ** 2).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum() + finite.sum()
        return jax.grad(loss, argnums=(0, 1))(q, kv)

    got = _sharded(grad, mesh, (P("data"), P(), P("data")), (P("data"), P()))(q, kv, indices)
    for g, want in zip(got, jax.jit(grad)(q, kv, indices), strict=True):
        assert relative_error(g, want) < 1e-5


# The custom call each implementation's kernels lower to.
CUSTOM_CALLS = {"triton": "xla.gpu.triton", "mosaic": "mosaic_gpu"}


def _lowered_for_cuda(fn, *args) -> str:
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("head_dim", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("implementation", KERNELS)
def test_kernels_lower_for_cuda_under_shard_map(implementation, head_dim, compiled_kernels):
    """Forward and backward kernels and the GEMMs lower as on a GPU: results vary like
    operands. (The Mosaic backward of a dense d128 mask fuses dQ here.)"""
    if implementation == "triton":
        skip_unless_triton_lowers_here()
    mesh = _mesh()
    batch = P("data")
    q = jax.ShapeDtypeStruct((4, 256, 2, head_dim), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((2,), jnp.float32)
    ids = jax.ShapeDtypeStruct((4, 256), jnp.int32)  # a traced mask, varying with the batch
    for is_causal, args in ((False, (q, q, q, sinks)), (True, (q, q, q, sinks, ids))):
        specs = (batch, batch, batch, P(), batch)[:len(args)]
        fn = _sharded(_attention_grad(implementation, is_causal), mesh, specs,
                      (batch, (batch, batch, batch, P())))
        assert _lowered_for_cuda(fn, *args).count(CUSTOM_CALLS[implementation]) >= 3

    def matmul_grad(a, w):
        loss = lambda a, w: omni_jax.matmul(a, w, implementation=implementation).sum()
        return jax.grad(loss, argnums=(0, 1))(a, w)

    a = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
    fn = _sharded(matmul_grad, mesh, (batch, P()), (batch, P()))
    assert CUSTOM_CALLS[implementation] in _lowered_for_cuda(fn, a, w)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", KERNELS)
def test_kernels_under_shard_map_on_gpu(implementation, seed):
    """The kernels per shard on up to two GPUs (one where the machine has one)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU")
    if implementation == "mosaic" and not runtime.can_run_mosaic_hopper():
        pytest.skip("needs an sm90 GPU")
    mesh = _mesh(min(2, len(jax.devices())))
    args = _attention_inputs(np.random.default_rng(seed), jnp.bfloat16, seq=300, head_dim=64)
    grad = _attention_grad(implementation)
    batch = P("data")
    out, grads = _sharded(grad, mesh, (batch, batch, batch, P(), batch),
                          (batch, (batch, batch, batch, P())))(*args)
    out_ref, grads_ref = jax.jit(grad)(*args)
    # The same kernels on the same data, up to a few bf16 roundings (XLA fuses the glue
    # around the kernels per program, and the sinks' gradient is summed over the devices
    # in another order: 2e-5 seen on two H100s). A wrong shard would be off by O(1).
    for got, want in zip((out, *grads), (out_ref, *grads_ref), strict=True):
        assert relative_error(got, want) < 1e-3


@pytest.fixture
def _interpreted_on_two_devices(monkeypatch):
    """The Mosaic kernels interpreted as sm90 on every device of a mesh. (The sm100
    forward's `plgpu.warp_map` is an inner ``mpmd_map`` over the kernel's refs, which jax
    0.11.2 and 0.12 reject inside a shard_map; `test_attention_bwd_sm100` runs the sm100
    backward there alone.)"""
    devices_share_the_interpreter(monkeypatch)
    yield from interpreted_mosaic(monkeypatch, "sm90")


@pytest.mark.interpreted
@pytest.mark.parametrize("is_causal,head_dim,deterministic", [
    (False, 128, False), (True, 128, False), (False, 64, True)],
    ids=["dense", "causal", "dense_ordered_d64"])
def test_mosaic_backward_fuses_dq_inside_shard_map(is_causal, head_dim, deterministic,
                                                   monkeypatch, _interpreted_on_two_devices):
    """Inside `jax.shard_map` the sm90 Mosaic backward sums dQ in its dK/dV kernel (one
    fused launch dense, a FULL and a masked one causal; the deterministic default's
    ordered adds at head dim 64) as it does outside, with gradients of the float64
    reference on each device's shard of the batch."""
    mesh = _mesh()
    # Causal walks here are a few tiles long: the fused dQ's walk threshold is lifted.
    force_config_fields(monkeypatch, attention_bwd_sm90, "backward_config",
                        fused_dq_min_full_walk=0.0)
    plans = record_plans(monkeypatch)
    fused = []
    accumulating = compat.mosaic_kernel_accumulating
    monkeypatch.setattr(compat, "mosaic_kernel_accumulating",
                        lambda *args, **kwargs: fused.append(1) or accumulating(*args, **kwargs))
    chosen = []
    fused_configs = attention_bwd_sm90._fused_configs
    monkeypatch.setattr(attention_bwd_sm90, "_fused_configs",
                        lambda *args, **kwargs: chosen.append(fused_configs(*args, **kwargs))
                        or chosen[-1])
    # Memory the kernels never write reads NaN (shapes are whole tiles, so no TMA read
    # overhangs into it): every gradient row must be written.
    params = runtime.mosaic_interpret_params
    monkeypatch.setattr(runtime, "mosaic_interpret_params",
                        lambda: dataclasses.replace(params(), uninitialized_memory="nan"))
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    # GQA, two query heads a kv head.
    shapes = ((2, 256, 2, head_dim), (2, 256, 1, head_dim), (2, 256, 1, head_dim))
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in shapes)
    dout = rng.standard_normal(shapes[0])
    dlse = rng.standard_normal((2, 2, 256))

    def gradients(q, k, v, dout, dlse):
        run = lambda q, k, v: omni_jax.attention(q, k, v, is_causal=is_causal,
                                                 return_lse=True, implementation="mosaic",
                                                 deterministic=deterministic)
        (out, lse), vjp = jax.vjp(run, q, k, v)
        return vjp((dout.astype(out.dtype), dlse))

    batch = P("data")
    got = _sharded(gradients, mesh, (batch,) * 5, (batch,) * 3)(
        q, k, v, jnp.asarray(dout, jnp.float32), jnp.asarray(dlse, jnp.float32))
    visible = dense_mask(2, 2, 256, 256, is_causal=is_causal)
    with jax.enable_x64(True):
        as64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
        _, vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, visible),
                         as64(q), as64(k), as64(v))
        expected = vjp((jnp.asarray(dout), jnp.asarray(dlse)))
    assert {plan.backward.name for plan in plans} == {"mosaic"} and fused, (plans, fused)
    ordered = {config.ordered_dq for configs in chosen for config in configs if config}
    assert ordered == {deterministic}, chosen
    for name, grad, want in zip(("dq", "dk", "dv"), got, expected, strict=True):
        grad = np.asarray(grad, np.float64)
        assert not np.isnan(grad).any(), (name, seed)
        assert relative_error(grad, np.asarray(want)) < 2e-2, (name, seed)


@pytest.fixture
def _sm100_on_two_devices(monkeypatch):
    devices_share_the_interpreter(monkeypatch)
    yield from interpreted_mosaic(monkeypatch, "sm100")


@pytest.mark.interpreted
def test_sm100_forward_inside_shard_map_falls_back_to_xla_and_says_so(monkeypatch,
                                                                     _sm100_on_two_devices):
    """The sm100 forward cannot run inside a shard_map (its warp map takes refs that vary
    along the mesh axes): the XLA forward serves, with a warning, and the sm100 backward
    still runs its kernel; gradients match the float64 reference."""
    skip_unless_blackwell_interpreter()
    mesh = _mesh()
    plans = record_plans(monkeypatch)
    rng = np.random.default_rng(0)
    shapes = ((2, 256, 2, 128), (2, 256, 1, 128), (2, 256, 1, 128))
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in shapes)
    dout = rng.standard_normal((2, 256, 2, 128)).astype(np.float32)

    def gradients(q, k, v, dout):
        run = lambda q, k, v: omni_jax.attention(q, k, v, is_causal=True,
                                                 implementation="mosaic", deterministic=False)
        out, vjp = jax.vjp(run, q, k, v)
        return vjp(dout.astype(out.dtype))

    batch = P("data")
    with pytest.warns(UserWarning, match="forward on the XLA backend inside"):
        got = _sharded(gradients, mesh, (batch,) * 4, (batch,) * 3)(q, k, v, jnp.asarray(dout))
    assert {plan.backward.name for plan in plans} == {"mosaic"}
    visible = dense_mask(2, 2, 256, 256, is_causal=True)
    with jax.enable_x64(True):
        as64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
        _, vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, visible)[0],
                         as64(q), as64(k), as64(v))
        expected = vjp(jnp.asarray(dout, jnp.float64))
    for name, grad, want in zip(("dq", "dk", "dv"), got, expected, strict=True):
        grad = np.asarray(grad, np.float64)
        assert not np.isnan(grad).any(), name
        assert relative_error(grad, np.asarray(want)) < 2e-2, name
