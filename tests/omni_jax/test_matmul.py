"""``omni_jax.matmul`` against a float64 reference on every implementation.

Without a GPU the Pallas implementations run interpreted (the Mosaic-GPU
interpreter with race detection), so shapes stay tiny and each kernel case is
chosen to cover something distinct: tails in every dimension, each operand
layout, each epilogue, each dtype, vmap batching, gradients. Interpreted, the
"mosaic" cases run twice: as Hopper's kernel (``OMNI_JAX_PALLAS_INTERPRET=1``) and
as Blackwell's (``=sm100``, from jax 0.11). The cases marked ``gpu`` run compiled, at
sizes with many tiles, on a real device.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax
from omni_jax import dispatch_log
from omni_jax.matmul import implementations
from pallas_kernels import runtime
from pallas_kernels.matmul_common import problem_of
from tests.jax_releases import skip_unless_blackwell_interpreter
from tests.omni_jax.matmul_helpers import (
    FP8_TOLERANCE,
    REFERENCE_ACTIVATIONS,
    TOLERANCE,
    assert_close,
    random_operands,
    reference,
)

BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
KERNELS = ("triton", "mosaic")
ON_GPU = jax.default_backend() == "gpu"


pytestmark = pytest.mark.usefixtures("interpret_pallas_without_gpu")


def pytest_generate_tests(metafunc):
    """Without a GPU, every case with an ``implementation`` runs under both interpreted
    architectures (`interpreted_as`)."""
    if "implementation" in metafunc.fixturenames and not ON_GPU:
        metafunc.parametrize("interpreted_as", ["sm90", "sm100"], indirect=True)


@pytest.fixture(autouse=True)
def interpreted_as(request, monkeypatch, interpret_pallas_without_gpu):
    """The GPU architecture the interpreter stands in for: "sm100" runs the "mosaic"
    cases on the Blackwell kernel (the other implementations are the same on both)."""
    architecture = getattr(request, "param", "sm90")
    if architecture == "sm100":
        if request.node.callspec.params.get("implementation") != "mosaic":
            pytest.skip("only the 'mosaic' implementation has a Blackwell kernel")
        skip_unless_blackwell_interpreter()
        monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "sm100")
    return architecture


def _skip_if_missing(implementation):
    reason = implementations.unavailable_reason(implementation)
    if reason is not None:
        pytest.skip(reason)


def _check(implementation, m, n, k, dtype, *, transpose_a=False, transpose_b=False,
           bias=False, activation=None, out_dtype=None, bias_dtype=F32):
    _skip_if_missing(implementation)
    a, b, bias_vector, seed = random_operands(
        m, n, k, dtype, transpose_a=transpose_a, transpose_b=transpose_b)
    bias_vector = bias_vector.astype(bias_dtype) if bias else None
    out = omni_jax.matmul(a, b, bias=bias_vector, activation=activation, out_dtype=out_dtype,
                          transpose_a=transpose_a, transpose_b=transpose_b,
                          implementation=implementation)
    expected_dtype = jnp.dtype(out_dtype or dtype)
    assert out.dtype == expected_dtype
    expected, product = (reference(a, b, bias=bias_vector, activation=act,
                                   transpose_a=transpose_a, transpose_b=transpose_b)
                         for act in (activation, None))
    assert_close(out, expected, expected_dtype, seed, magnitude=product)


# ------------------------------------------------------------------------- XLA: every combination

@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (33, 65, 17)])
@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (True, False),
                                                     (False, True), (True, True)])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_xla_shapes_layouts_dtypes(m, n, k, transpose_a, transpose_b, dtype):
    _check("xla", m, n, k, dtype, transpose_a=transpose_a, transpose_b=transpose_b)


@pytest.mark.parametrize("activation", [None, "gelu", "gelu_tanh", "silu", "relu"])
@pytest.mark.parametrize("out_dtype", [BF16, F32])
def test_xla_epilogues(activation, out_dtype):
    _check("xla", 9, 11, 13, BF16, bias=True, activation=activation, out_dtype=out_dtype)


def test_xla_empty_contraction_gives_bias():
    a = jnp.ones((3, 0), BF16)
    b = jnp.ones((0, 4), BF16)
    bias = jnp.arange(4.0)
    out = omni_jax.matmul(a, b, bias=bias, out_dtype=F32)
    np.testing.assert_array_equal(out, np.broadcast_to(np.arange(4.0), (3, 4)))


# ----------------------------------------------------- Pallas kernels (interpreted without a GPU)

# (M, N, K) per kernel: none a multiple of a CTA tile, so tails are masked. Triton
# takes any size; the Mosaic kernel's TMA views need rows of a multiple of 128
# bytes (and a multiple of 8 rows for a read as (K, M) or b as (K, N)).
@pytest.mark.parametrize("implementation,m,n,k,transpose_a,transpose_b", [
    ("triton", 67, 24, 40, False, False),
    ("triton", 72, 24, 40, True, False),
    ("triton", 67, 24, 40, False, True),
    ("triton", 72, 24, 40, True, True),
    ("triton", 200, 136, 136, False, False),
    ("mosaic", 67, 64, 64, False, False),
    ("mosaic", 128, 64, 128, True, False),
    ("mosaic", 67, 64, 64, False, True),
    ("mosaic", 192, 128, 64, True, True),
    ("mosaic", 200, 192, 192, False, False),  # several tiles: persistent loop, ring wrap-around
])
def test_kernel_layouts_and_tails(implementation, m, n, k, transpose_a, transpose_b):
    _check(implementation, m, n, k, BF16, transpose_a=transpose_a, transpose_b=transpose_b,
           out_dtype=F32)


@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("activation", [None, "gelu", "gelu_tanh", "silu", "relu"])
def test_kernel_epilogues(implementation, activation):
    _check(implementation, 40, 64, 64, BF16, bias=True, activation=activation)


@pytest.mark.parametrize("implementation", ["xla", *KERNELS])
@pytest.mark.parametrize("bias_dtype", [BF16, F16])
def test_16_bit_bias_is_read_as_given(implementation, bias_dtype):
    """A 16-bit bias reaches the kernels as is (no conversion op before them) and is
    widened in their epilogue."""
    _check(implementation, 40, 64, 64, BF16, bias=True, activation="gelu_tanh",
           bias_dtype=bias_dtype)
    a, b, bias, _ = random_operands(40, 64, 64, BF16)
    jaxpr = jax.make_jaxpr(lambda a, b, c: omni_jax.matmul(
        a, b, bias=c, implementation=implementation))(a, b, bias.astype(bias_dtype))
    assert not any(eqn.primitive.name == "convert_element_type" for eqn in jaxpr.jaxpr.eqns)


@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("dtype,out_dtype", [(F16, F16), (F16, F32), (BF16, F16)])
def test_kernel_dtypes(implementation, dtype, out_dtype):
    _check(implementation, 40, 64, 64, dtype, out_dtype=out_dtype)


@pytest.mark.parametrize("implementation", ["xla", *KERNELS])
@pytest.mark.parametrize("dtype,transpose_a,transpose_b", [
    (E4M3, False, True), (E4M3, False, False), (E5M2, True, False),
])
def test_fp8_with_scales(implementation, dtype, transpose_a, transpose_b):
    _skip_if_missing(implementation)
    m, n, k = 40, 128, 128
    a, b, bias, seed = random_operands(m, n, k, dtype, transpose_a=transpose_a,
                                       transpose_b=transpose_b)
    a_scale, b_scale = 0.5, 3.0
    out = omni_jax.matmul(a, b, bias=bias, a_scale=a_scale, b_scale=b_scale,
                          transpose_a=transpose_a, transpose_b=transpose_b,
                          implementation=implementation)
    assert out.dtype == BF16
    expected = reference(a, b, bias=bias, transpose_a=transpose_a, transpose_b=transpose_b,
                         scale=a_scale * b_scale)
    assert_close(out, expected, BF16, seed)


@pytest.mark.parametrize("implementation", ["xla", *KERNELS])
def test_vmap_is_one_batched_call(implementation, monkeypatch):
    """vmap over a (and the bias), b shared: one kernel call with a batch grid axis."""
    _skip_if_missing(implementation)
    module = implementations.module(implementation)
    calls = []
    kernel = module.matmul
    monkeypatch.setattr(module, "matmul", lambda a, b, *args, **kwargs: (
        calls.append((a.shape, b.shape)) or kernel(a, b, *args, **kwargs)))
    batch, m, n, k = 3, 24, 64, 64
    a, b, _, seed = random_operands(m, n, k, BF16, batch=(batch,))
    b = b[0]
    biases = jax.random.normal(jax.random.key(seed + 1), (batch, n), jnp.float32)

    def one(a, bias):
        return omni_jax.matmul(a, b, bias=bias, activation="relu", out_dtype=F32,
                               implementation=implementation)

    out = jax.vmap(one)(a, biases)
    expected = np.stack([reference(a[i], b, bias=biases[i], activation="relu")
                         for i in range(batch)])
    assert_close(out, expected, F32, seed)
    # One batched call (a with its batch axis, b with a size-1 broadcast axis); the
    # unbatched trace custom_vmap makes for the output type runs no kernel.
    assert [c for c in calls if len(c[0]) == 3] == [((batch, m, k), (1, k, n))]


@pytest.mark.parametrize("implementation", ["xla", *KERNELS])
def test_nested_vmap_broadcasts_operands(implementation):
    """vmap over a's outer axis and b's inner axis: a (2, 1) x b (1, 3) batch grid."""
    _skip_if_missing(implementation)
    m, n, k = 24, 64, 64
    a, _, bias, seed = random_operands(m, n, k, BF16, batch=(2,))
    _, b, _, _ = random_operands(m, n, k, BF16, batch=(3,))

    def one(a, b):
        return omni_jax.matmul(a, b, bias=bias, out_dtype=F32, implementation=implementation)

    out = jax.vmap(lambda a: jax.vmap(lambda b: one(a, b))(b))(a)
    assert out.shape == (2, 3, m, n)
    expected = np.stack([np.stack([reference(a[i], b[j], bias=bias) for j in range(3)])
                         for i in range(2)])
    assert_close(out, expected, F32, seed)


# (dtype, the operands vmap maps); the others are shared. fp8 calls carry both epilogue
# vectors, scale and bias, so each is mapped once while the other is shared.
@pytest.mark.parametrize("dtype,mapped", [
    (BF16, ("bias",)),
    (E4M3, ("bias",)),
    (E4M3, ("a_scale",)),
    (E4M3, ("a", "b_scale")),
    (E5M2, ("b", "a_scale", "bias")),
])
@pytest.mark.parametrize("implementation", ["xla", *KERNELS])
def test_vmap_over_any_operands(implementation, dtype, mapped):
    """The result's batch is that of every mapped operand, epilogue vectors included, and
    each operand is read at its own batch index."""
    _skip_if_missing(implementation)
    batch, m, n, k = 3, 24, 64, 128
    a, b, _, seed = random_operands(m, n, k, dtype, batch=(batch,))
    bias_key, a_key, b_key = jax.random.split(jax.random.key(seed + 1), 3)
    operands = dict(a=a, b=b, bias=jax.random.normal(bias_key, (batch, n), F32))
    fp8 = dtype in (E4M3, E5M2)
    if fp8:
        operands.update(a_scale=jax.random.uniform(a_key, (batch,), F32, 0.5, 2.0),
                        b_scale=jax.random.uniform(b_key, (batch,), F32, 0.5, 2.0))
    operands = {name: x if name in mapped else x[0] for name, x in operands.items()}

    def one(operands):
        return omni_jax.matmul(**operands, out_dtype=F32, implementation=implementation)

    out = jax.vmap(one, in_axes=({name: 0 if name in mapped else None for name in operands},))(
        operands)

    def example(i):
        return {name: x[i] if name in mapped else x for name, x in operands.items()}

    expected = np.stack([
        reference(x["a"], x["b"], bias=x["bias"],
                  scale=float(x["a_scale"] * x["b_scale"]) if fp8 else 1.0)
        for x in map(example, range(batch))])
    assert_close(out, expected, F32, seed, tolerance=FP8_TOLERANCE if fp8 else None)


@pytest.mark.parametrize("implementation", ["xla", *KERNELS])
@pytest.mark.parametrize("dtype,out_dtype,transpose_a,transpose_b,activation,bias_dtype", [
    (BF16, F32, False, False, "gelu", BF16), (BF16, F32, True, True, None, F32),
    # 16-bit outputs with pre-activations far below zero, past float16's range (see below)
    (BF16, BF16, False, False, "silu", BF16),
    (F16, F16, False, False, "silu", F32), (F16, F16, False, True, "gelu_tanh", F32),
    (F16, F16, True, False, "gelu", F32),
])
def test_gradients(implementation, dtype, out_dtype, transpose_a, transpose_b, activation,
                   bias_dtype):
    _skip_if_missing(implementation)
    m, n, k = 64, 64, 128
    a, b, bias, seed = random_operands(m, n, k, dtype, transpose_a=transpose_a,
                                       transpose_b=transpose_b)
    if out_dtype != F32:
        # Every other column's pre-activation lies near -1e5, past float16's -65504, where
        # the activation gives -0. Under differentiation the output and the gradients there
        # were NaN: the pre-activation was kept in float16 (-inf), and silu's derivative
        # was inf / inf below -88 in any dtype.
        bias = bias.at[::2].add(-1e5)
    bias = bias.astype(bias_dtype)
    cotangent = jax.random.normal(jax.random.key(seed + 1), (m, n), jnp.float32)

    def gemm(a, b, bias):
        return omni_jax.matmul(a, b, bias=bias, activation=activation, out_dtype=out_dtype,
                               transpose_a=transpose_a, transpose_b=transpose_b,
                               implementation=implementation)

    out, gemm_vjp = jax.vjp(gemm, a, b, bias)
    grads = gemm_vjp(cotangent.astype(out_dtype))
    with jax.enable_x64(True):
        expected_out, reference_vjp = jax.vjp(
            lambda a, b, bias: reference_traceable(a, b, bias, activation, transpose_a,
                                                   transpose_b),
            *(jnp.asarray(np.asarray(x, np.float64)) for x in (a, b, bias)))
        expected = reference_vjp(jnp.asarray(np.asarray(cotangent.astype(out_dtype),
                                                        np.float64)))
        expected_out, expected = np.asarray(expected_out), [np.asarray(e) for e in expected]
    assert_close(out, expected_out, out_dtype, seed)
    for name, got, want, primal in zip(("a", "b", "bias"), grads, expected, (a, b, bias),
                                       strict=True):
        assert got.shape == want.shape and got.dtype == primal.dtype, name
        # Gradients pass through the input dtype (dC is rounded before the backward GEMMs).
        assert_close(got, want, dtype, seed, tolerance=2 * TOLERANCE[dtype])


def reference_traceable(a, b, bias, activation, transpose_a, transpose_b):
    a = a.T if transpose_a else a
    b = b.T if transpose_b else b
    return REFERENCE_ACTIVATIONS[activation](a @ b + bias)


def test_vmap_of_grad_and_grad_of_vmap_agree():
    a, b, _, seed = random_operands(8, 8, 16, F32, batch=(2,))
    b = b[0]

    def loss(a, b):
        return jnp.sum(omni_jax.matmul(a, b, activation="silu") ** 2)

    per_example = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None))(a, b)
    batched = jax.grad(lambda a, b: jnp.sum(jax.vmap(loss, (0, None))(a, b)), (0, 1))(a, b)
    np.testing.assert_allclose(per_example[0], batched[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(per_example[1].sum(0), batched[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (True, True)])
@pytest.mark.parametrize("activation", [None, "gelu", "silu"])
def test_hessian_matches_float64(activation, transpose_a, transpose_b):
    """jax.hessian (forward mode over the custom_vjp's rules, under jacfwd's vmap) and a
    Hessian-vector product through a vmapped matmul. The forward rule called the
    custom_vjp function itself (no JVP), and the JVP of the batched GEMM recursed."""
    a, b, bias, seed = random_operands(6, 5, 8, F32, transpose_a=transpose_a,
                                       transpose_b=transpose_b)

    def loss(a, b, bias):
        out = omni_jax.matmul(a, b, bias=bias, activation=activation, transpose_a=transpose_a,
                              transpose_b=transpose_b, implementation="xla")
        return (out ** 3).sum()

    def reference_loss(a, b, bias):
        return (reference_traceable(a, b, bias, activation, transpose_a, transpose_b) ** 3).sum()

    def batched_loss(loss, a, b, biases):  # The bias batched, a and b shared.
        return jax.vmap(loss, in_axes=(None, None, 0))(a, b, biases).sum()

    biases = jax.random.normal(jax.random.key(seed + 1), (3, 5), jnp.float32)
    tangents = tuple(jax.random.normal(jax.random.key(seed + 2 + i), x.shape, jnp.float32)
                     for i, x in enumerate((a, b, biases)))
    argnums = (0, 1, 2)
    hessian = jax.jit(jax.hessian(loss, argnums))(a, b, bias)
    hvp = jax.jit(lambda *args: jax.jvp(
        jax.grad(lambda *x: batched_loss(loss, *x), argnums), args, tangents)[1])(a, b, biases)
    with jax.enable_x64(True):
        as64 = lambda xs: tuple(jnp.asarray(np.asarray(x, np.float64)) for x in xs)
        want_hessian = jax.hessian(reference_loss, argnums)(*as64((a, b, bias)))
        want_hvp = jax.jvp(jax.grad(lambda *x: batched_loss(reference_loss, *x), argnums),
                           as64((a, b, biases)), as64(tangents))[1]
    # float32 second derivatives of a cubic loss through gelu: random draws reached 1.2e-4
    # (jax 0.12.0.1) and 1.6e-4 (0.10.2, in CI) against the former 1e-4.
    tolerance = 3e-4
    for i in argnums:
        for j in argnums:
            assert_close(hessian[i][j], np.asarray(want_hessian[i][j]), F32, seed,
                         tolerance=tolerance)
        assert_close(hvp[i], np.asarray(want_hvp[i]), F32, seed, tolerance=tolerance)


def test_jit():
    a, b, bias, seed = random_operands(16, 8, 24, BF16)
    out = jax.jit(lambda a, b, bias: omni_jax.matmul(a, b, bias=bias, activation="gelu",
                                                     out_dtype=F32))(a, b, bias)
    assert_close(out, reference(a, b, bias=bias, activation="gelu"), F32, seed)


# --------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs,error,message", [
    (dict(a=jnp.ones((2, 3, 4), BF16)), ValueError, "a must be 2-D"),
    (dict(b=jnp.ones((4,), BF16)), ValueError, "b must be 2-D"),
    (dict(b=jnp.ones((5, 6), BF16)), ValueError, "contraction sizes differ"),
    (dict(b=jnp.ones((4, 6), F16)), TypeError, "a and b must have one dtype"),
    (dict(a=jnp.ones((3, 4), jnp.int32), b=jnp.ones((4, 6), jnp.int32)), TypeError,
     "a must have dtype"),
    (dict(bias=jnp.ones((5,))), ValueError, r"bias must have shape \(N,\) = \(6,\)"),
    (dict(bias=jnp.ones((6,), jnp.int32)), TypeError, "bias must be a floating"),
    (dict(activation="tanh"), ValueError, "activation must be None or one of"),
    (dict(out_dtype=jnp.int8), TypeError, "out_dtype must be one of"),
    (dict(a_scale=2.0), ValueError, "a_scale is for fp8 .* only; a and b are bfloat16"),
    (dict(a=jnp.ones((3, 4), E4M3), b=jnp.ones((4, 6), E4M3), b_scale="2"), TypeError,
     "b_scale must be a real number or a scalar array, got str '2'"),
    (dict(implementation="cuda"), ValueError, "implementation must be None or one of"),
    (dict(transpose_a=1), TypeError, "transpose_a must be a bool"),
    (dict(a="x"), TypeError, "a must be an array"),
])
def test_errors_name_the_argument(kwargs, error, message):
    args = dict(a=jnp.ones((3, 4), BF16), b=jnp.ones((4, 6), BF16))
    args.update(kwargs)
    a, b = args.pop("a"), args.pop("b")
    with pytest.raises(error, match=message):
        omni_jax.matmul(a, b, **args)


def test_fp8_scale_must_be_scalar():
    a = jnp.ones((8, 16), E4M3)
    b = jnp.ones((16, 16), E4M3)
    with pytest.raises(ValueError, match="b_scale must be a scalar"):
        omni_jax.matmul(a, b, b_scale=jnp.ones((16,)))


def test_fp8_gradients_are_refused():
    a = jnp.ones((8, 16), E4M3)
    b = jnp.ones((16, 16), E4M3)
    with pytest.raises(TypeError, match="gradients through fp8"):
        jax.grad(lambda a: omni_jax.matmul(a, b, out_dtype=F32).sum())(a)


def test_kernel_that_cannot_serve_says_why():
    _skip_if_missing("mosaic")
    a = jnp.ones((8, 64), BF16)
    b = jnp.ones((64, 40), BF16)  # rows of 80 bytes: the TMA tiles are 128 bytes wide
    with pytest.raises(ValueError, match="implementation='mosaic' cannot serve.*b .stored as"):
        omni_jax.matmul(a, b, implementation="mosaic")


@pytest.mark.skipif(ON_GPU, reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize(("implementation", "message"), [
    ("mosaic", r"Hopper \(sm90\) or datacenter Blackwell \(sm100\) GPU \(or "
               r"OMNI_JAX_PALLAS_INTERPRET=1 .*, =sm100 as Blackwell\); this device is not a CUDA "
               r"GPU$"),
    ("triton", r"compute capability 8.0 or newer \(or OMNI_JAX_PALLAS_INTERPRET=1 .*\)$"),
])
def test_unavailable_kernel_says_why(implementation, message, monkeypatch):
    monkeypatch.delenv(runtime.INTERPRET_ENV_VAR)
    with pytest.raises(ValueError,
                       match=rf"implementation='{implementation}' cannot serve.*{message}"):
        omni_jax.matmul(jnp.ones((8, 16), BF16), jnp.ones((16, 8), BF16),
                        implementation=implementation)


@pytest.mark.parametrize("setting,capability,expected", [
    ("sm100", None, "matmul_sm100"),
    ("1", None, "matmul_sm90"),
    ("", (10, 0), "matmul_sm100"),
    ("", (10, 3), "matmul_sm100"),
    ("", (9, 0), "matmul_sm90"),
])
def test_mosaic_resolves_to_the_architecture_s_kernel(setting, capability, expected,
                                                      monkeypatch):
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, setting)
    monkeypatch.setattr(runtime, "gpu_compute_capability", lambda: capability)
    assert implementations.unavailable_reason("mosaic") is None
    assert implementations.module("mosaic").__name__ == f"pallas_kernels.mosaic.{expected}"


@pytest.mark.parametrize("capability", [None, (12, 0), (8, 0)])
def test_no_mosaic_kernel_elsewhere_names_both_architectures(capability, monkeypatch):
    monkeypatch.delenv(runtime.INTERPRET_ENV_VAR, raising=False)
    monkeypatch.setattr(runtime, "gpu_compute_capability", lambda: capability)
    reason = implementations.unavailable_reason("mosaic")
    assert "Hopper (sm90)" in reason and "Blackwell (sm100)" in reason


def test_the_choice_is_logged_with_the_reasons(caplog, monkeypatch):
    """DEBUG: the implementation a call takes; INFO: a backward GEMM that cannot take the
    forward's implementation, with the reason."""
    monkeypatch.setattr(dispatch_log, "_logged", set())
    caplog.set_level(logging.DEBUG, logger="omni_jax")
    omni_jax.matmul(jnp.ones((8, 16), BF16), jnp.ones((16, 24), BF16))
    (record,) = [r for r in caplog.records if r.name == implementations.__name__]
    assert record.levelno == logging.DEBUG
    assert record.getMessage().startswith("matmul [8 x 24 x 16, bfloat16 -> bfloat16]: ")
    caplog.clear()
    monkeypatch.setattr(implementations, "why_not",
                        lambda name, problem: "declined here" if name == "mosaic" else None)
    problem = problem_of(jnp.ones((8, 16), BF16), jnp.ones((16, 24), BF16), None, None,
                         transpose_a=False, transpose_b=False, activation=None, out_dtype=BF16)
    assert implementations.fallback("mosaic", problem) != "mosaic"
    (record,) = caplog.records
    assert record.levelno == logging.INFO and "not mosaic: declined here" in record.getMessage()


def test_default_implementation_on_cpu_is_xla():
    if ON_GPU:
        pytest.skip("CPU default")
    a, b, _, _ = random_operands(8, 8, 8, BF16)
    jaxpr = str(jax.make_jaxpr(omni_jax.matmul)(a, b))
    assert "pallas_call" not in jaxpr and "dot_general" in jaxpr


# ------------------------------------------------------------------------ compiled, on a GPU

# Tails against every tile size; Mosaic's sizes are multiples of 64 (its TMA tiling).
GPU_SHAPES = {
    "triton": ((1000, 1048, 1544), (4104, 2056, 3000)),
    "mosaic": ((1088, 1088, 1600), (1003, 1088, 1600), (4160, 2112, 3008)),
}

@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (True, False),
                                                     (False, True), (True, True)])
@pytest.mark.parametrize("dtype,out_dtype", [(BF16, BF16), (F16, F32)])
def test_gpu_large_odd_shapes(implementation, transpose_a, transpose_b, dtype, out_dtype):
    served = 0
    for m, n, k in GPU_SHAPES[implementation]:
        a, b, _, _ = random_operands(m, n, k, dtype, transpose_a=transpose_a,
                                     transpose_b=transpose_b)
        problem = problem_of(a, b, None, None, transpose_a=transpose_a,
                             transpose_b=transpose_b, activation=None,
                             out_dtype=out_dtype or dtype)
        if implementations.why_not(implementation, problem):
            continue  # e.g. Mosaic with a read as (K, M) and M not a multiple of 64
        served += 1
        _check(implementation, m, n, k, dtype, transpose_a=transpose_a,
               transpose_b=transpose_b, out_dtype=out_dtype)
    assert served


def _random_problem(rng, implementation):
    """(m, n, k, dtype, out_dtype, transpose_a, transpose_b, activation, bias, fp8 scales):
    drawn again until ``implementation`` serves it (the Mosaic kernel's TMA tiles refuse
    some row widths)."""

    def pick(options):
        return options[int(rng.integers(len(options)))]

    while True:
        m, n, k = (max(1, int(x)) for x in np.exp(rng.uniform(0, np.log(3000), 3)))
        dtype = pick((BF16, F16, E4M3, E5M2))
        out_dtype = pick((None, F32, F16)) if dtype.itemsize == 2 else pick((BF16, F32))
        transpose_a, transpose_b = bool(rng.integers(2)), bool(rng.integers(2))
        scales = (0.5, 4.0) if dtype.itemsize == 1 else (None, None)
        shapes = ((k, m) if transpose_a else (m, k), (n, k) if transpose_b else (k, n))
        problem = problem_of(
            *(jax.ShapeDtypeStruct(shape, dtype) for shape in shapes),
            None if scales[0] is None else jnp.ones((1,), F32), None,
            transpose_a=transpose_a, transpose_b=transpose_b, activation=None,
            out_dtype=jnp.dtype(out_dtype or (dtype if dtype.itemsize == 2 else BF16)))
        if implementation is None or implementations.why_not(implementation, problem) is None:
            return (m, n, k, dtype, out_dtype, transpose_a, transpose_b,
                    pick((None, "gelu", "silu")), bool(rng.integers(2)), scales)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("draw", range(6))
@pytest.mark.parametrize("implementation", [*KERNELS, None], ids=str)
def test_gpu_random_problems(implementation, draw):
    """Sizes from 1 to 3000 per side, layouts, dtypes and epilogues drawn at random (fresh
    each run; a failure names them all)."""
    if implementation is not None:
        _skip_if_missing(implementation)
    drawn = _random_problem(np.random.default_rng(), implementation)
    m, n, k, dtype, out_dtype, transpose_a, transpose_b, activation, with_bias, scales = drawn
    a, b, bias, seed = random_operands(m, n, k, dtype, transpose_a=transpose_a,
                                       transpose_b=transpose_b)
    bias = bias if with_bias else None
    out = omni_jax.matmul(a, b, bias=bias, activation=activation, out_dtype=out_dtype,
                          transpose_a=transpose_a, transpose_b=transpose_b,
                          a_scale=scales[0], b_scale=scales[1], implementation=implementation)
    expected, product = (reference(a, b, bias=bias, activation=act, transpose_a=transpose_a,
                                   transpose_b=transpose_b,
                                   scale=1.0 if scales[0] is None else scales[0] * scales[1])
                         for act in (activation, None))
    tolerance = TOLERANCE[out.dtype] if dtype.itemsize == 2 else max(TOLERANCE[out.dtype],
                                                                     FP8_TOLERANCE)
    assert_close(out, expected, out.dtype, f"{seed}, problem {drawn}", tolerance,
                 magnitude=product)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("activation", [None, "gelu", "gelu_tanh", "silu", "relu"])
def test_gpu_epilogues(implementation, activation):
    m, n, k = GPU_SHAPES[implementation][0]
    _check(implementation, m - 8, n, k, BF16, bias=True, activation=activation)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_gpu_fp8(implementation, dtype):
    _skip_if_missing(implementation)
    a, b, bias, seed = random_operands(1000, 1024, 2048, dtype, transpose_b=True)
    out = omni_jax.matmul(a, b, bias=bias, a_scale=0.25, b_scale=2.0, transpose_b=True,
                          implementation=implementation)
    expected = reference(a, b, bias=bias, transpose_b=True, scale=0.5)
    assert_close(out, expected, BF16, seed)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.smoke
@pytest.mark.parametrize("implementation", KERNELS)
def test_gpu_vmap_and_grad(implementation):
    _skip_if_missing(implementation)
    batch, m, n, k = 4, 520, 320, 1024
    a, b, bias, seed = random_operands(m, n, k, BF16, batch=(batch,))

    def loss(a, b):
        out = omni_jax.matmul(a, b, bias=bias, activation="gelu", out_dtype=F32,
                              implementation=implementation)
        return jnp.sum(out * out)

    grads = jax.jit(jax.vmap(jax.grad(loss, (0, 1))))(a, b)
    with jax.enable_x64(True):
        def reference_loss(a, b):
            out = jax.nn.gelu(a @ b + jnp.asarray(bias, jnp.float64), approximate=False)
            return jnp.sum(out * out)

        want = jax.vmap(jax.grad(reference_loss, (0, 1)))(
            jnp.asarray(np.asarray(a, np.float64)), jnp.asarray(np.asarray(b, np.float64)))
    for got, expected in zip(grads, want, strict=True):
        assert_close(got, np.asarray(expected), BF16, seed, tolerance=2e-2)
