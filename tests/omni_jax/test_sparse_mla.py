"""Portable sparse MLA prefill against float64 references; argument errors; jit/vmap/grad."""

from __future__ import annotations

import logging

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax import dispatch_log, sparse_mla_prefill
from omni_jax.sparse_mla import kernel
from tests.omni_jax.sparse_mla_reference import dense_loss_fn, reference_forward
from tests.reference import relative_error


def make_inputs(seed, *, s_q=6, h_q=4, s_kv=40, d_qk=24, topk=80, dtype=jnp.bfloat16,
                invalid_fraction=0.2, poison=None):
    """Random inputs with invalid (negative and >= s_kv) and duplicate indices.

    With ``poison`` (a non-finite value), no valid index lists kv row 0 and that row
    holds ``poison``: a result that reads it for an invalid index turns non-finite.
    """
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((s_q, h_q, d_qk)), dtype)
    kv = jnp.asarray(rng.standard_normal((s_kv, 1, d_qk)), dtype)
    if poison is not None:
        kv = kv.at[0].set(poison)
    indices = rng.integers(0 if poison is None else 1, s_kv, (s_q, 1, topk))
    indices[0, 0, :3] = indices[0, 0, 3]  # duplicates
    invalid = rng.random((s_q, 1, topk)) < invalid_fraction
    indices[invalid] = rng.choice([-1, -7, s_kv, s_kv + 5], invalid.sum())
    indices[-1] = -1  # a row with no valid index
    return q, kv, jnp.asarray(indices, jnp.int32)


@pytest.mark.parametrize("poison", [None, np.inf], ids=["finite", "inf_in_unlisted_row"])
@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 1e-2), (jnp.float32, 1e-5)])
@pytest.mark.parametrize("topk", [80, 64])
def test_forward_matches_float64_reference(dtype, tol, topk, poison, seed):
    q, kv, indices = make_inputs(seed=seed, dtype=dtype, topk=topk, poison=poison)
    sm_scale, d_v = 0.3, 16
    out, max_logits, lse, scores = sparse_mla_prefill(
        q, kv, indices, sm_scale=sm_scale, d_v=d_v, return_scores=True, implementation="xla"
    )
    ref = reference_forward(q, kv, indices, sm_scale=sm_scale, d_v=d_v)
    assert out.dtype == dtype and out.shape == (6, 4, d_v)
    assert max_logits.dtype == lse.dtype == scores.dtype == jnp.float32
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert relative_error(out, ref[0]) < tol
    assert relative_error(max_logits, ref[1]) < 1e-5
    assert relative_error(lse, ref[2]) < 1e-5
    assert relative_error(scores, ref[3]) < 1e-5
    np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0.0)
    assert np.all(np.isneginf(lse[-1])) and np.all(np.isneginf(max_logits[-1]))


def test_duplicates_count_twice(seed):
    q, kv, _ = make_inputs(seed=seed, s_q=1, topk=8, dtype=jnp.float32)
    once = jnp.asarray([[[3, 5]]], jnp.int32)
    twice = jnp.asarray([[[3, 5, 5]]], jnp.int32)
    kw = dict(sm_scale=1.0, d_v=8, implementation="xla")
    lse_once = sparse_mla_prefill(q, kv, once, **kw)[2]
    lse_twice = sparse_mla_prefill(q, kv, twice, **kw)[2]
    s5 = jnp.einsum("hd,d->h", q[0], kv[5, 0])
    np.testing.assert_allclose(jnp.exp(lse_twice), jnp.exp(lse_once) + jnp.exp(s5)[None], 1e-5)


def test_without_scores_returns_three_outputs_under_jit(seed):
    q, kv, indices = make_inputs(seed=seed)
    fn = jax.jit(lambda q, kv, i: sparse_mla_prefill(q, kv, i, sm_scale=0.2, d_v=16))
    outputs = fn(q, kv, indices)
    assert len(outputs) == 3
    ref = reference_forward(q, kv, indices, sm_scale=0.2, d_v=16)
    assert relative_error(outputs[0], ref[0]) < 1e-2


def test_the_path_taken_is_logged(seed, caplog, monkeypatch):
    """DEBUG: the kernel or the portable path, with the reason the kernel declined."""
    monkeypatch.setattr(dispatch_log, "_logged", set())
    caplog.set_level(logging.DEBUG, logger="omni_jax")
    q, kv, indices = make_inputs(seed=seed)
    sparse_mla_prefill(q, kv, indices, sm_scale=0.2, d_v=16)
    (record,) = [r for r in caplog.records if r.name == "omni_jax.sparse_mla.api"]
    message = record.getMessage()
    assert message.startswith("sparse_mla_prefill ProblemShape(s_q=6, h_q=4, d_qk=24")
    assert "the portable path (" in message  # the kernel takes d_qk 576 only


def test_vmap_over_batch_axis(seed):
    batch = [make_inputs(seed=seed + b, s_q=4, topk=70) for b in range(3)]
    q, kv, indices = (jnp.stack(xs) for xs in zip(*batch, strict=True))
    fn = jax.vmap(lambda q, kv, i: sparse_mla_prefill(
        q, kv, i, sm_scale=0.25, d_v=16, return_scores=True))
    outputs = jax.jit(fn)(q, kv, indices)
    for b in range(3):
        ref = reference_forward(*batch[b], sm_scale=0.25, d_v=16)
        assert relative_error(outputs[0][b], ref[0]) < 1e-2
        assert relative_error(outputs[2][b], ref[2]) < 1e-5
        assert relative_error(outputs[3][b], ref[3]) < 1e-5


@pytest.mark.parametrize("poison", [None, np.nan], ids=["finite", "nan_in_unlisted_row"])
@pytest.mark.parametrize("with_scores", [False, True])
def test_gradients_match_float64_dense_reference(with_scores, poison, seed):
    q, kv, indices = make_inputs(seed=seed, s_q=5, h_q=2, s_kv=30, d_qk=16, topk=72,
                                 dtype=jnp.float32, poison=poison)
    sm_scale, d_v = 0.4, 12
    rng = np.random.default_rng(seed + 1)
    w_out = rng.standard_normal((5, 2, d_v))
    w_lse = rng.standard_normal((5, 2))
    w_scores = rng.standard_normal((5, 2, 72)) if with_scores else np.zeros((5, 2, 72))

    def loss(q, kv):
        outputs = sparse_mla_prefill(q, kv, indices, sm_scale=sm_scale, d_v=d_v,
                                     return_scores=with_scores, implementation="xla")
        total = jnp.sum(outputs[0] * w_out) + jnp.sum(jnp.where(
            jnp.isneginf(outputs[2]), 0.0, outputs[2]) * w_lse)
        if with_scores:
            total += jnp.sum(jnp.where(jnp.isneginf(outputs[3]), 0.0, outputs[3]) * w_scores)
        return total

    dq, dkv = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, kv)
    with jax.enable_x64(True):
        ref_loss = dense_loss_fn(indices, sm_scale=sm_scale, d_v=d_v,
                                 weights=(w_out, w_lse, w_scores))
        ref_dq, ref_dkv = jax.grad(ref_loss, argnums=(0, 1))(
            jnp.asarray(q, jnp.float64), jnp.asarray(kv, jnp.float64))
        ref_dq, ref_dkv = np.asarray(ref_dq), np.asarray(ref_dkv)
    assert relative_error(dq, ref_dq) < 1e-4
    assert relative_error(dkv, ref_dkv) < 1e-4
    np.testing.assert_array_equal(np.asarray(dq[-1]), 0.0)  # the all-invalid row
    if poison is not None:  # only invalid indices could reach row 0
        np.testing.assert_array_equal(np.asarray(dkv[0]), 0.0)


def test_bfloat16_gradients_under_vmap(seed):
    batch = [make_inputs(seed=seed + b, s_q=3, topk=64) for b in range(2)]
    q, kv, indices = (jnp.stack(xs) for xs in zip(*batch, strict=True))

    def loss(q, kv, i):
        return sparse_mla_prefill(q, kv, i, sm_scale=0.2, d_v=16)[0].astype(jnp.float32).sum()

    dq, dkv = jax.vmap(jax.grad(loss, argnums=(0, 1)))(q, kv, indices)
    for b in range(2):
        with jax.enable_x64(True):
            ref_loss = dense_loss_fn(batch[b][2], sm_scale=0.2, d_v=16,
                                     weights=(np.ones((3, 4, 16)), 0.0, 0.0))
            ref = jax.grad(ref_loss, argnums=(0, 1))(
                jnp.asarray(batch[b][0], jnp.float64), jnp.asarray(batch[b][1], jnp.float64))
        assert relative_error(dq[b], ref[0]) < 3e-2
        assert relative_error(dkv[b], ref[1]) < 3e-2


def test_memory_is_blockwise():
    """No intermediate of size s_q * topk * d (the gathered kv of all listed rows)."""
    s_q, topk, d = 8, 1024, 64
    q = jax.ShapeDtypeStruct((s_q, 1, d), jnp.float32)
    kv = jax.ShapeDtypeStruct((32, 1, d), jnp.float32)
    indices = jax.ShapeDtypeStruct((s_q, 1, topk), jnp.int32)

    def loss(q, kv, i):
        return sparse_mla_prefill(q, kv, i, sm_scale=1.0, d_v=d, implementation="xla")[0].sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(q, kv, indices)
    limit = s_q * topk * d // 4
    sizes = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            sizes.extend(int(np.prod(v.aval.shape)) for v in eqn.outvars)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        visit(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        visit(sub)

    visit(jaxpr.jaxpr)
    assert max(sizes) <= limit


GOOD = dict(
    q=jnp.zeros((4, 2, 8), jnp.bfloat16),
    kv=jnp.zeros((5, 1, 8), jnp.bfloat16),
    indices=jnp.zeros((4, 1, 3), jnp.int32),
)


@pytest.mark.parametrize(
    "change,error,message",
    [
        (dict(q=jnp.zeros((4, 8), jnp.bfloat16)), ValueError, r"q must have rank 3.*\(4, 8\)"),
        (dict(q=[[1.0]]), TypeError, "q must be a jax or numpy array"),
        (dict(kv=jnp.zeros((5, 2, 8), jnp.bfloat16)), ValueError, "h_kv = 1.*h_kv=2"),
        (dict(kv=jnp.zeros((5, 1, 6), jnp.bfloat16)), ValueError, "d_qk=8.*\\(5, 1, 6\\)"),
        (dict(kv=jnp.zeros((5, 1, 8), jnp.float32)), TypeError, "kv must have the dtype of q"),
        (dict(q=jnp.zeros((4, 2, 8), jnp.int32), kv=jnp.zeros((5, 1, 8), jnp.int32)),
         TypeError, "q must have a floating dtype"),
        (dict(indices=jnp.zeros((4, 1, 3), jnp.float32)), TypeError,
         "indices must have dtype int32"),
        (dict(indices=jnp.zeros((3, 1, 3), jnp.int32)), ValueError, "s_q=4.*\\(3, 1, 3\\)"),
        (dict(indices=jnp.zeros((4, 2, 3), jnp.int32)), ValueError, "h_kv=1 heads"),
        (dict(indices=jnp.zeros((4, 1, 0), jnp.int32)), ValueError, "topk >= 1"),
        (dict(d_v=9), ValueError, "d_v <= d_qk=8, got d_v=9"),
        (dict(d_v=4.0), TypeError, "d_v must be a static integer.*got float 4.0"),
        (dict(d_v=True), TypeError, "d_v must be a static integer.*got bool True"),
        (dict(d_v=jnp.int32(4)), TypeError, r"d_v must be a static integer.*shape \(\)"),
        (dict(sm_scale=-1.0), ValueError, "sm_scale must be a finite positive"),
        (dict(sm_scale=np.float32(np.nan)), ValueError, "sm_scale must be a finite positive"),
        (dict(sm_scale=jnp.float32(1.0)), TypeError,
         r"sm_scale must be a static real number.*not a jax array.*shape \(\)"),
        (dict(sm_scale=np.ones(1)), TypeError, r"sm_scale must be a static.*shape \(1,\)"),
        (dict(implementation="cuda"), ValueError, "implementation must be one of"),
        (dict(return_scores=1), TypeError, "return_scores must be a bool"),
    ],
)
def test_bad_arguments_raise_clear_errors(change, error, message):
    args = dict(GOOD, sm_scale=1.0, d_v=4, return_scores=False, implementation=None) | change
    with pytest.raises(error, match=message):
        sparse_mla_prefill(
            args.pop("q"), args.pop("kv"), args.pop("indices"), **args
        )


def test_numpy_scalars_are_static_arguments(seed):
    q, kv, indices = make_inputs(seed=seed, dtype=jnp.float32)
    expected = sparse_mla_prefill(q, kv, indices, sm_scale=0.25, d_v=8, implementation="xla")
    actual = sparse_mla_prefill(q, kv, indices, sm_scale=np.float32(0.25), d_v=np.int64(8),
                                implementation="xla")
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def test_traced_sm_scale_names_the_problem():
    traced = jax.jit(lambda scale: sparse_mla_prefill(GOOD["q"], GOOD["kv"], GOOD["indices"],
                                                      sm_scale=scale, d_v=4))
    with pytest.raises(TypeError, match="sm_scale must be a static real number.*Tracer"):
        traced(0.5)


def test_ffi_rejects_shapes_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="implementation='ffi' cannot run.*d_qk=576"):
        sparse_mla_prefill(GOOD["q"], GOOD["kv"], GOOD["indices"], sm_scale=1.0, d_v=4,
                           implementation="ffi")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the no-GPU message")
def test_ffi_without_gpu_names_why():
    q = jnp.zeros((1, 64, 576), jnp.bfloat16)
    kv = jnp.zeros((4, 1, 576), jnp.bfloat16)
    indices = jnp.zeros((1, 1, 64), jnp.int32)
    with pytest.raises(RuntimeError, match="implementation='ffi' is unavailable.*not a CUDA GPU"):
        sparse_mla_prefill(q, kv, indices, sm_scale=1.0, implementation="ffi")
    # implementation=None falls back to the portable path.
    out = sparse_mla_prefill(q, kv, indices, sm_scale=1.0)[0]
    assert out.shape == (1, 64, 512)


@pytest.mark.parametrize("return_scores", [False, True])
def test_kernel_call_lowers_for_cuda_under_jit_and_vmap(return_scores):
    """The custom call (with sm_scale as a static f32 attribute) lowers without a GPU."""
    q = jnp.zeros((2, 3, 64, 576), jnp.bfloat16)
    kv = jnp.zeros((2, 10, 1, 576), jnp.bfloat16)
    indices = jnp.zeros((2, 3, 1, 128), jnp.int32)
    fn = jax.jit(jax.vmap(lambda q, kv, i: kernel.forward(
        q, kv, i, sm_scale=0.125, return_scores=return_scores)))
    text = fn.trace(q, kv, indices).lower(lowering_platforms=("cuda",)).as_text()
    target = kernel.SCORES_TARGET_NAME if return_scores else kernel.TARGET_NAME
    assert f"@{target}(" in text
    assert "sm_scale = 1.250000e-01 : f32" in text
    assert "tensor<2x3x64x512xbf16>" in text  # batch axes reach the handler
