"""Walk hints of context-parallel step masks: the trace-time statistics of each step,
and the kernels' configs they lead to, equal those of the concrete step masks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from omni_jax.backends import plan_attention
from omni_jax.backends.mosaic import MosaicBackend
from omni_jax.context_parallel import ring
from omni_jax.context_parallel.steps import ContextCall, step_mask, step_walk_hint
from omni_jax.problem import AttentionProblem
from pallas_kernels import runtime
from pallas_kernels.block_sparse import WalkStatistics
from pallas_kernels.mosaic import attention_bwd_sm90 as bwd
from pallas_kernels.mosaic import attention_fwd_sm90 as fwd
from tests.forced_configs import record_configs
from tests.omni_jax.context_parallel import checks
from tests.reference import dense_mask, reference_attention, relative_error


def _call(num_shards: int, shard_len: int, *, is_causal: bool, window, layout: str,
          rotate: bool, block_size=(16, 16), head_dim: int = 8, dtype=np.float32,
          ) -> ContextCall:
    kv_len = shard_len if rotate else num_shards * shard_len
    problem = AttentionProblem(batch=1, q_len=shard_len, kv_len=kv_len, num_q_heads=2,
                               num_kv_heads=2, head_dim=head_dim, head_dim_v=head_dim,
                               dtype=np.dtype(dtype),
                               scale=1.0, softcap=None, score_mod=None, has_sinks=False,
                               has_user_mask=False, block_size=block_size)
    return ContextCall(plan=plan_attention("xla", problem), is_causal=is_causal,
                       window=window, axis="seq", num_shards=num_shards, layout=layout,
                       rotate=rotate)


def _concrete_statistics(call: ContextCall, step: int) -> list[WalkStatistics]:
    """Per device: the statistics of the step mask built from concrete positions."""
    statistics = []
    for device in range(call.num_shards):
        source = (device - step) % call.num_shards if call.rotate else None
        mask = step_mask(call, step, call.q_positions(device), call.kv_positions(source),
                         None, None)
        statistics.append(mask.walk_statistics())
    return statistics


@pytest.mark.parametrize(("num_shards", "shard_len", "is_causal", "window"), [
    (2, 64, True, None),
    (4, 96, True, (40, 0)),  # the last step is empty on every device (window)
    (3, 80, False, (24, 24)),
])
@pytest.mark.parametrize("layout", checks.LAYOUTS)
@pytest.mark.parametrize("rotate", [True, False], ids=["ring", "allgather"])
def test_step_hints_are_the_mean_over_devices_that_run_the_step(
        num_shards, shard_len, is_causal, window, layout, rotate):
    call = _call(num_shards, shard_len, is_causal=is_causal, window=window, layout=layout,
                 rotate=rotate)
    for step in range(num_shards if rotate else 1):
        per_device = _concrete_statistics(call, step)
        running = [s for s in per_device if s.mean_kv_blocks > 0] or per_device
        hint = step_walk_hint(call, step)
        np.testing.assert_allclose(
            (hint.mean_kv_blocks, hint.mean_full_q_blocks),
            (np.mean([s.mean_kv_blocks for s in running]),
             np.mean([s.mean_full_q_blocks for s in running])), rtol=1e-12)


def test_causal_zigzag_ring_hints_are_exact_on_every_device():
    """Step 0 is local causal, every later step half FULL tiles and half empty: the
    same on every device, so the mean is each device's own statistics."""
    call = _call(4, 128, is_causal=True, window=None, layout="zigzag", rotate=True)
    for step in range(4):
        per_device = _concrete_statistics(call, step)
        assert all(s == per_device[0] for s in per_device), per_device
        assert step_walk_hint(call, step) == per_device[0]
    nq = 128 // 16
    assert step_walk_hint(call, 1) == WalkStatistics(nq / 2, nq / 2)


def _stub_kernels(monkeypatch) -> tuple[list, list]:
    """Records the Mosaic forward's configs and the backward's mean_full_walk; the stubs
    return zeros (these tests only trace)."""
    forward_configs, full_walks = [], []

    def forward(q, k, v, kmask, layout, *, config, **kwargs):
        forward_configs.append(config)
        return (jnp.zeros((*q.shape[:3], v.shape[-1]), q.dtype),
                jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32))

    def backward(q, k, v, kmask, layout, out, lse, dout, dlse, *, mean_full_walk, **kwargs):
        full_walks.append(mean_full_walk)
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), jnp.zeros_like(lse)

    monkeypatch.setattr(fwd, "attention_forward", forward)
    monkeypatch.setattr(bwd, "attention_backward", backward)
    return forward_configs, full_walks


@pytest.mark.parametrize("window", [None, (300, 0)])
def test_traced_mask_with_hint_gets_the_concrete_masks_configs(window, monkeypatch):
    """A traced mask without a hint takes the worst case (every kv-block, no fused dQ);
    with its hint, the configs of the same mask concrete."""
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    forward_configs, full_walks = _stub_kernels(monkeypatch)
    call = _call(2, 2048, is_causal=True, window=window, layout="zigzag", rotate=True,
                 block_size=(128, 128))
    problem = call.plan.problem
    q = jax.ShapeDtypeStruct((1, 2048, 2, 128), jnp.bfloat16)
    backend = MosaicBackend()

    def run(mask):
        def both(q):
            out, lse = backend.forward(problem, q, q, q, mask(), None, ())
            backend.backward(problem, q, q, q, mask(), None, (), out, lse, out, lse)
        jax.eval_shape(both, q)

    concrete = step_mask(call, 1, call.q_positions(1), call.kv_positions(0), None, None)
    run(lambda: concrete)
    traced = lambda positions: step_mask(call, 1, positions, call.kv_positions(0), None, None)
    run(lambda: traced(jnp.asarray(call.q_positions(1)) + jnp.zeros((), jnp.int32)))
    run(lambda: traced(call.q_positions(1) + jnp.zeros((), jnp.int32)).with_walk_hint(None))
    assert forward_configs[0] == forward_configs[1] and full_walks[0] == full_walks[1]
    assert full_walks[0] == concrete.walk_statistics().mean_full_q_blocks > 0
    assert full_walks[2] is None
    assert forward_configs[2] != forward_configs[0]  # what the hint changes


@pytest.mark.interpreted
def test_ring_steps_pass_their_hints_to_the_mosaic_kernels(monkeypatch):
    """Traced through the ring (shards as vmap lanes): each step's kernels see its
    statistics, as a concrete mask of that step would give them."""
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    forward_configs, full_walks = _stub_kernels(monkeypatch)
    steps = []
    real_step_mask = ring.step_mask
    monkeypatch.setattr(ring, "step_mask", lambda call, step, *args: steps.append(
        (call, step)) or real_step_mask(call, step, *args))
    (q, k, v, sinks, ids), kwargs = checks._inputs("window", 2, jnp.bfloat16, 0, 512, 1,
                                                    dim=128)
    run = checks._over_a_vmap_axis(checks._loss_and_grads(
        {"is_causal": True, "implementation": "mosaic"}, context_axis="seq",
        context_strategy="ring", context_layout="zigzag"), 2)
    jax.eval_shape(run, q, k, v, sinks, ids)
    assert len(steps) == 4 and len(full_walks) == 2  # two steps, forward and backward
    for (call, step), walk in zip(steps[2:], full_walks, strict=True):
        want = np.mean([s.mean_full_q_blocks for s in _concrete_statistics(call, step)])
        assert walk == pytest.approx(want) and walk > 0


@pytest.mark.interpreted
def test_traced_short_walk_step_runs_the_short_walk_forward(seed, monkeypatch,
                                                            interpret_pallas_without_gpu):
    """A window step's hint gives its traced mask the short-walk config (two q-blocks per
    CTA), once only concrete masks': the kernel computes the same attention with it."""
    configs = record_configs(monkeypatch, fwd, "attention_forward")
    call = _call(2, 512, is_causal=True, window=(100, 0), layout="contiguous", rotate=True,
                 block_size=(128, 128), head_dim=128, dtype=jnp.bfloat16)
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 512, 2, 128)), jnp.bfloat16)
               for _ in range(3))

    @jax.jit
    def step(q_positions, q, k, v):  # device 1's own block: positions 512...1023
        mask = step_mask(call, 0, q_positions, call.kv_positions(1), None, None)
        return MosaicBackend().forward(call.plan.problem, q, k, v, mask, None, ())

    out, lse = step(call.q_positions(1), q, k, v)
    assert configs[0].q_blocks_per_cta == 2, configs
    with jax.enable_x64(True):
        want_out, want_lse = reference_attention(
            q, k, v, dense_mask(1, 2, 512, 512, is_causal=True, window=(100, 0)),
            scale=call.plan.problem.scale)
    assert relative_error(out, want_out) < 2e-2 and relative_error(lse, want_lse) < 1e-3
