"""The shared attention suite on the Mosaic-GPU backend.

`TestMosaicAttentionInterpreted` runs a representative subset through the
Mosaic-GPU interpreter on any machine (races fail the test);
`TestMosaicAttentionGpu` runs the full suite compiled on an sm90 GPU. Both
check that every call took its backward from the Mosaic kernels (not from
the Triton fallback). `TestMosaicSm100AttentionInterpreted` runs every case
interpreted as sm100 (jax 0.11 and later): the Blackwell forward and backward.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax
from omni_jax.backends.mosaic import MosaicBackend
from omni_jax.problem import AttentionProblem
from pallas_kernels import compat, runtime
from pallas_kernels.mosaic import attention_bwd_sm90 as bwd
from pallas_kernels.mosaic import attention_bwd_sm100 as bwd100
from pallas_kernels.mosaic import attention_fwd_sm90 as fwd
from pallas_kernels.mosaic import attention_fwd_sm100 as fwd100
from pallas_kernels.mosaic import attention_sm90_common as common
from tests.forced_configs import force_config_fields, record_configs, record_plans
from tests.jax_releases import skip_unless_blackwell_interpreter
from tests.mosaic_interpret import interpreted_mosaic
from tests.omni_jax.attention_suite import CASES, AttentionSuite, Case, check_case

# The kernels take bf16/fp16, q tiles of 128 rows, and score_mods that read captured
# arrays by batch and head only (ALiBi slopes), not per score (a relative-position table).
_GATHERING = ("relative_table_score_mod",)
GPU_CASES = tuple(case for case in CASES if case.name not in _GATHERING)
_INTERPRETED = ("causal_ragged", "decode_step_gqa_sinks",
                "documents_causal_window",
                "generic_block_mask", "mqa_value_dim", "per_head_mask_without_gqa",
                "score_mod_nan_past_the_ends", "softcap_sinks")
INTERPRETED_CASES = tuple(case for case in CASES if case.name in _INTERPRETED)


@dataclasses.dataclass(frozen=True)
class ForwardVariant:
    """A consumer schedule of the forward kernel and its q-blocks per CTA."""

    pipelined: bool
    q_blocks_per_cta: int

    def __str__(self) -> str:
        return f"{'pipelined' if self.pipelined else 'serial'}-{self.q_blocks_per_cta}qblocks"


# The default first: the other tests of the suite run under it alone.
FORWARD_VARIANTS = tuple(ForwardVariant(pipelined, per_cta)
                         for pipelined in (True, False) for per_cta in (1, 2))


class _MosaicSuite(AttentionSuite):
    implementation = "mosaic"
    mask_block_size = (128, 64)
    variants = FORWARD_VARIANTS

    def test_case(self, case, dtype, variant, monkeypatch):
        """Every case under both consumer schedules of the forward kernel, with one and
        with two q-blocks per CTA."""
        force_config_fields(monkeypatch, fwd, "forward_config", pipelined=variant.pipelined,
                            q_blocks_per_cta=variant.q_blocks_per_cta)
        super().test_case(case, dtype)

    @pytest.fixture(autouse=True)
    def _mosaic_backward(self, monkeypatch):
        plans = record_plans(monkeypatch)
        yield
        names = {plan.backward.name for plan in plans}
        assert names == {"mosaic"}, names


@pytest.mark.interpreted
class TestMosaicAttentionInterpreted(_MosaicSuite):
    dtypes = ("bfloat16",)
    cases = INTERPRETED_CASES

    @classmethod
    def slow(cls, **params):
        """Every case under the default schedule; each other schedule on two cases, in
        turn (all of them under ``-m slow``)."""
        variant = params.get("variant")
        if variant in (None, FORWARD_VARIANTS[0]) or "case" not in params:
            return False
        return (INTERPRETED_CASES.index(params["case"]) // 2
                != FORWARD_VARIANTS.index(variant) - 1)

    @pytest.fixture(autouse=True)
    def _interpreted(self, monkeypatch):
        yield from interpreted_mosaic(monkeypatch)


@pytest.mark.interpreted
class TestMosaicSm100AttentionInterpreted(AttentionSuite):
    """Every case (output, lse, gradients, blind rows) against float64, interpreted as
    sm100."""

    implementation = "mosaic"
    dtypes = ("bfloat16",)
    cases = GPU_CASES
    mask_block_size = (128, 128)  # the sm100 backward's kv tile

    @classmethod
    def slow(cls, **params):
        """The sm90 suite's interpreted cases; the others under ``-m slow``."""
        return "case" in params and params["case"] not in INTERPRETED_CASES

    @pytest.fixture(autouse=True)
    def _interpreted(self, monkeypatch):
        skip_unless_blackwell_interpreter()
        yield from interpreted_mosaic(monkeypatch, "sm100")

    def test_case(self, case, dtype, monkeypatch):
        """The case, run by the sm100 kernels: the backward's up to head dim 128 (above,
        the forward takes 64-row kv tiles, which the backward declines)."""
        configs = record_configs(monkeypatch, fwd100, "attention_forward")
        backward_configs = record_configs(monkeypatch, bwd100, "attention_backward")
        super().test_case(case, dtype)
        assert configs and all(isinstance(c, fwd100.ForwardConfig) for c in configs)
        if max(case.head_dim, case.head_dim_v or 0) <= 128:
            assert backward_configs


@pytest.mark.gpu
@pytest.mark.skipif(runtime.interpret_requested() or runtime.gpu_compute_capability() != (9, 0),
                    reason="needs an sm90 GPU (compiled Mosaic-GPU kernels)")
class TestMosaicAttentionGpu(_MosaicSuite):
    dtypes = ("bfloat16", "float16")
    cases = GPU_CASES
    smoke_cases = ("causal_ragged", "documents_causal_window", "softcap_sinks")

    @classmethod
    def wanted(cls, **params):
        """The schedules are dtype-independent (the interpreted suite runs them too):
        float16 under the default one."""
        return params.get("dtype") != "float16" or params.get("variant") in (
            None, FORWARD_VARIANTS[0])


@pytest.mark.gpu
@pytest.mark.skipif(runtime.interpret_requested() or runtime.gpu_compute_capability() != (9, 0),
                    reason="needs an sm90 GPU (compiled Mosaic-GPU kernels)")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", [
    Case("dense_head_dim_128", batch=1, q_len=256, kv_len=256, heads=4, kv_heads=2,
         head_dim=128, deterministic=False),
    # Masked tiles: the FULL steps in one fused launch, the masked ones in a second
    # (taken here whatever the walk length).
    Case("causal_ragged_head_dim_128", batch=2, q_len=300, kv_len=400, heads=4, kv_heads=2,
         head_dim=128, is_causal=True, deterministic=False),
    Case("window_alibi_sinks_head_dim_128", batch=1, q_len=512, kv_len=512, heads=4,
         kv_heads=1, head_dim=128, is_causal=True, window=(200, 0), score_mod="alibi",
         sinks=True, deterministic=False),
    # Head dim 64: 128-row steps, dQ split by rows between the two dK/dV consumers.
    Case("dense_head_dim_64", batch=1, q_len=256, kv_len=256, heads=4, kv_heads=2,
         head_dim=64, deterministic=False),
    Case("causal_ragged_head_dim_64", batch=2, q_len=300, kv_len=400, heads=4, kv_heads=2,
         head_dim=64, is_causal=True, deterministic=False),
], ids=lambda case: case.name)
@pytest.mark.parametrize("overlapped_step", [True, False], ids=["overlapped", "serial"])
@pytest.mark.parametrize("dq_fields", [
    {}, {"dq_reducer_warp": False}, {"one_commit_a_step": False, "q_major_scores": False},
    {"serial_dq_with_dkdv": True}, {"auto_barriers": True}, {"q_major_scores": False}],
    ids=["reducer", "consumer_adds", "two_commits", "dq_with_dkdv", "auto_barriers",
         "transposed"])
def test_fused_dq_backward_through_the_public_call(case, dtype, overlapped_step, dq_fields,
                                                   monkeypatch):
    """Head dims 128 and 64, deterministic=False: the dK/dV kernel also sums dQ (into a
    ref), a path the suite's short walks never take; in both step orders
    (`BackwardConfig.overlapped_step`), its reductions issued by the producer (dS^T
    published with the dQ stage or apart) or by the consumers, and in the serial order
    dQ issued with dV and dK; with Pallas's automatic barriers, which the default
    leaves out (only compiled kernels differ: the interpreter runs both the same); and
    at head dim 128 with transposed score tiles as well as its default q-major ones."""
    if overlapped_step and dq_fields.get("serial_dq_with_dkdv"):
        pytest.skip("serial_dq_with_dkdv applies to the serial order only")
    if "q_major_scores" in dq_fields and not (overlapped_step and case.head_dim == 128):
        pytest.skip("the score tiles' orientation is a choice of the overlapped step's "
                    "64-row steps")
    force_config_fields(monkeypatch, bwd, "backward_config", fused_dq_min_full_walk=0.0,
                        overlapped_step=overlapped_step, **dq_fields)
    plans = record_plans(monkeypatch)
    accumulating = []
    kernel = compat.mosaic_kernel_accumulating
    monkeypatch.setattr(compat, "mosaic_kernel_accumulating",
                        lambda *args, **kwargs: accumulating.append(1) or kernel(*args, **kwargs))
    check_case("mosaic", case, dtype, (128, 128), block_rows=32)
    backends = {plan.backward.name for plan in plans}
    assert backends == {"mosaic"} and accumulating, (backends, accumulating)


@pytest.mark.gpu
@pytest.mark.skipif(runtime.interpret_requested() or runtime.gpu_compute_capability() != (9, 0),
                    reason="needs an sm90 GPU (global semaphores: the interpreter has none)")
@pytest.mark.parametrize("case", [
    Case("dense_head_dim_128", batch=2, q_len=1024, kv_len=1024, heads=8, kv_heads=2,
         head_dim=128),
    Case("dense_head_dim_64", batch=2, q_len=1024, kv_len=1024, heads=8, kv_heads=2,
         head_dim=64),
    # 32 kv-blocks a head, as in training at 4096 tokens: many CTAs add to a q step at once.
    Case("dense_s4096_head_dim_128", batch=1, q_len=4096, kv_len=4096, heads=2, kv_heads=2,
         head_dim=128),
    Case("dense_softcap_sinks_head_dim_64", batch=1, q_len=2048, kv_len=2048, heads=4,
         kv_heads=1, head_dim=64, softcap=20.0, sinks=True),
    # 72 kv-blocks a head, past half of an H100's SMs: two groups order their adds apart.
    Case("dense_s9216_head_dim_64", batch=1, q_len=9216, kv_len=9216, heads=2, kv_heads=1,
         head_dim=64),
    # Masked tiles: the dQ kernel, deterministic too.
    Case("causal_ragged_head_dim_128", batch=2, q_len=1000, kv_len=1100, heads=4,
         kv_heads=2, head_dim=128, is_causal=True),
], ids=lambda case: case.name)
def test_deterministic_backward_repeats_bit_for_bit(case, monkeypatch):
    """deterministic=True (the default), the ordered fused dQ forced at every head dim:
    under masks of FULL tiles only its adds go in a fixed order
    (`BackwardConfig.ordered_dq`), elsewhere the dQ kernel serves; the gradients match
    float64 and every rerun of the backward gives the same bits."""
    force_config_fields(monkeypatch, bwd, "backward_config", fused_dq_min_full_walk=0.0,
                        ordered_dq=True)
    accumulating = []
    kernel = compat.mosaic_kernel_accumulating
    monkeypatch.setattr(compat, "mosaic_kernel_accumulating",
                        lambda *args, **kwargs: accumulating.append(1) or kernel(*args, **kwargs))
    check_case("mosaic", case, "bfloat16", (128, 128), block_rows=32, repeats=4)
    assert bool(accumulating) == (not case.is_causal), accumulating


@pytest.mark.parametrize("captured,score_mod,match", [
    (jnp.ones((8,), jnp.float32), lambda t: lambda s, b, h, i, j: s + t[jnp.clip(i - j, 0, 7)],
     "by query or key position"),
    (jnp.ones((4,), jnp.float32), lambda t: lambda s, b, h, i, j: s + t.sum(), "reduce_sum"),
    (jnp.ones((4,), jnp.int32), lambda t: lambda s, b, h, i, j: s + t[h], "int32"),
    (jnp.ones((2000,), jnp.float32), lambda t: lambda s, b, h, i, j: s + t[h], "2000 elements"),
])
def test_score_mod_captures_beyond_element_reads_are_declined(captured, score_mod, match,
                                                              monkeypatch):
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    q = jnp.ones((1, 64, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        omni_jax.attention(q, q, q, score_mod=score_mod(captured), implementation="mosaic")


_SLOPES = jnp.ones((2,), jnp.float32)


def _backward_backends(head_dim, block_kv, score_mod, monkeypatch,
                       interpret: str = "1") -> list[str]:
    """The backward backends planned for a default-dispatch call on interpreted kernels
    (``interpret``: the setting of ``OMNI_JAX_PALLAS_INTERPRET``)."""
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, interpret)
    plans = record_plans(monkeypatch)
    q = jax.ShapeDtypeStruct((1, 256, 2, head_dim), jnp.bfloat16)
    mask = None if block_kv is None else omni_jax.create_block_mask(
        lambda b, h, i, j: i >= j, None, None, 256, 256, (128, block_kv))
    jax.eval_shape(lambda q: omni_jax.attention(q, q, q, mask=mask, score_mod=score_mod,
                                                implementation="mosaic"), q)
    return [plan.backward.name for plan in plans]


@pytest.mark.parametrize("head_dim,block_kv,score_mod", [
    (128, None, None),
    (256, None, None),
    (64, 64, None),
    (64, None, lambda s, b, h, i, j: s - 0.1 * (i - j)),
    (64, None, lambda s, b, h, i, j: s - _SLOPES[h] * (i - j)),  # captures an array
])
def test_backward_is_mosaic_where_the_forward_is(head_dim, block_kv, score_mod, monkeypatch):
    assert _backward_backends(head_dim, block_kv, score_mod, monkeypatch) == ["mosaic"]


def test_backward_falls_back_without_a_config(monkeypatch):
    """Every head dim the forward takes has a backward config; a problem without one
    (say, a head dim added to the forward alone) still trains, through the next backend
    in the device's order (Triton on GPUs)."""
    monkeypatch.setattr(bwd, "backward_config", lambda *args, **kwargs: None)
    names = _backward_backends(128, None, None, monkeypatch)
    assert len(names) == 1 and names[0] != "mosaic", names


def test_sm100_backward_serves_its_kv_tile_and_declines_others(monkeypatch):
    """On sm100 the Mosaic backward takes 128-row kv tiles (the forward's up to head dim
    128); above, the forward's 64-row tiles send gradients to the next backend."""
    skip_unless_blackwell_interpreter()
    assert _backward_backends(128, None, None, monkeypatch, interpret="sm100") == ["mosaic"]
    names = _backward_backends(256, None, None, monkeypatch, interpret="sm100")
    assert len(names) == 1 and names[0] != "mosaic", names


def test_sm100_retiles_a_block_kv_it_lacks(monkeypatch):
    """The sm100 forward takes kv tiles of 64 or 128: a concrete mask of 192 is re-tiled."""
    skip_unless_blackwell_interpreter()
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "sm100")
    configs = record_configs(monkeypatch, fwd100, "attention_forward")
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    mask = omni_jax.create_block_mask(lambda b, h, i, j: i >= j, None, None, 256, 256,
                                      (128, 192))
    jax.eval_shape(lambda q: omni_jax.attention(q, q, q, mask=mask, implementation="mosaic"),
                   q)
    assert [config.block_kv for config in configs] == [128]


def _problem(q_len: int, kv_len: int) -> AttentionProblem:
    """A bf16 MHA problem at head dim 128, as the backends' decisions see it."""
    return AttentionProblem(
        batch=1, q_len=q_len, kv_len=kv_len, num_q_heads=4, num_kv_heads=4, head_dim=128,
        head_dim_v=128, dtype=np.dtype(jnp.bfloat16), scale=0.1, softcap=None,
        score_mod=None, has_sinks=False, has_user_mask=False)


@pytest.mark.parametrize("architecture", ["sm90", "sm100"])
def test_atomic_dq_sums_only_when_not_deterministic(architecture, monkeypatch):
    """The dQ sums that TMA reduce-adds add to in no fixed order (sm90's fused dQ unless
    ordered, sm100's one sum) vary in their last bits between runs: only
    deterministic=False takes them; sm90's deterministic default orders its fused dQ
    where that beats the dQ kernel (head dim 64) and takes the dQ kernel elsewhere. A
    deterministic sm100 backward whose per-kv-block sums would be too large is
    declined."""
    if architecture == "sm100":
        skip_unless_blackwell_interpreter()
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1" if architecture == "sm90" else "sm100")
    problem = _problem(4096, 4096)
    config = MosaicBackend()._backward_config
    if architecture == "sm90":
        head_dim_64 = dataclasses.replace(problem, head_dim=64, head_dim_v=64)
        assert config(head_dim_64).fused_dq and config(head_dim_64).ordered_dq
        assert not config(problem).fused_dq and config(
            dataclasses.replace(problem, deterministic=False)).fused_dq
    atomic = (lambda c: c.fused_dq and not c.ordered_dq) if architecture == "sm90" else (
        lambda c: not c.deterministic)
    assert not atomic(config(problem))
    assert atomic(config(dataclasses.replace(problem, deterministic=False)))
    if architecture == "sm100":
        long = dataclasses.replace(problem, q_len=32768, kv_len=32768)
        assert "deterministic=True" in config(long)
        assert atomic(config(dataclasses.replace(long, deterministic=False)))


def test_walks_beyond_shared_memory_are_declined_with_the_reason(monkeypatch):
    """The kernels hold a block's whole walk in shared memory: a sequence whose walks do
    not fit beside the tiles goes to the next backend (a named "mosaic" raises), never
    to a kernel that fails to compile. Forward: walks over the kv-blocks; backward (dK/dV):
    over the q-blocks."""
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    backend = MosaicBackend()
    assert backend.unsupported_reason(_problem(262144, 262144)) is None
    assert not isinstance(backend._backward_config(_problem(262144, 262144)), str)
    assert "walks over 4096 kv-blocks" in backend.unsupported_reason(_problem(1024, 524288))
    assert backend.unsupported_reason(_problem(1 << 21, 1024)) is None
    assert "16384 q-blocks" in backend.backward_unsupported_reason(_problem(1 << 21, 1024))
    q = jax.ShapeDtypeStruct((1, 524288, 1, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):
        jax.eval_shape(lambda q: omni_jax.attention(q, q, q, implementation="mosaic"), q)


def test_sm100_walks_beyond_shared_memory_are_declined(monkeypatch):
    """The sm100 kernels hold their walk rows in shared memory as well (the forward's
    paired over both q tiles)."""
    skip_unless_blackwell_interpreter()
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "sm100")
    backend = MosaicBackend()
    assert backend.unsupported_reason(_problem(8192, 8192)) is None
    assert "kv-blocks" in backend.unsupported_reason(_problem(1024, 524288))
    long_queries = dataclasses.replace(_problem(1 << 21, 1024), deterministic=False)
    assert "q-blocks" in backend.backward_unsupported_reason(long_queries)


@pytest.fixture
def _interpreted(monkeypatch):
    yield from interpreted_mosaic(monkeypatch)


@pytest.mark.interpreted
@pytest.mark.parametrize("head_dim,head_dim_v", [(256, None), (192, 128)])
def test_wide_head_dims_interpreted(head_dim, head_dim_v, monkeypatch, _interpreted):
    """The public call above head dim 128 with the default configs, fitted to shared
    memory as on the GPU: dK and dV by paired consumers, the dQ kernel's V-first order;
    ragged causal under GQA."""
    plans = record_plans(monkeypatch)
    case = Case("causal_ragged_gqa", batch=1, q_len=200, kv_len=260, heads=2, kv_heads=1,
                head_dim=head_dim, head_dim_v=head_dim_v, is_causal=True)
    check_case("mosaic", case, "bfloat16", (128, 64), block_rows=32)
    backends = {plan.backward.name for plan in plans}
    assert backends == {"mosaic"}, backends
    config = bwd.backward_config(head_dim, head_dim_v or head_dim, jnp.bfloat16, causal=True)
    assert config.dq_v_first and bwd.pairs_consumers(config)


@pytest.mark.gpu
@pytest.mark.skipif(runtime.interpret_requested() or runtime.gpu_compute_capability() != (9, 0),
                    reason="needs an sm90 GPU (compiled Mosaic-GPU kernels)")
@pytest.mark.parametrize("q_blocks_per_cta", [1, 2])
@pytest.mark.parametrize("head_dim,head_dim_v",
                         [(96, None), (192, None), (256, None), (192, 128), (256, 64)])
@pytest.mark.parametrize("case", [
    Case("causal_ragged", batch=1, q_len=700, kv_len=900, heads=2, kv_heads=1, is_causal=True),
    Case("causal_documents", batch=1, q_len=640, kv_len=640, heads=2, kv_heads=1,
         segments="packed", is_causal=True),
], ids=lambda case: case.name)
def test_wide_head_dims_compiled(case, head_dim, head_dim_v, q_blocks_per_cta, monkeypatch):
    """The suite runs compiled at head dim 32; these are the forward's other configs (96
    on 128's, 192 on 256's tiles) with one and two q-blocks per CTA, and the backward's
    (above 128: dK and dV by paired consumers at 192 and 256, by one consumer at 192 /
    128 and 256 / 64)."""
    force_config_fields(monkeypatch, fwd, "forward_config", q_blocks_per_cta=q_blocks_per_cta)
    plans = record_plans(monkeypatch)
    check_case("mosaic", dataclasses.replace(case, head_dim=head_dim, head_dim_v=head_dim_v),
               "bfloat16", (128, 64), block_rows=32)
    backends = {plan.backward.name for plan in plans}
    assert backends == {"mosaic"}, backends


@pytest.mark.gpu
@pytest.mark.skipif(runtime.interpret_requested() or runtime.gpu_compute_capability() != (9, 0),
                    reason="needs an sm90 GPU (compiled Mosaic-GPU kernels)")
@pytest.mark.parametrize("num_consumers", [3, 2])
@pytest.mark.parametrize("q_len", [768, 1000])
def test_dense_head_dim_64_consumers_compiled(q_len, num_consumers, monkeypatch):
    """Dense head dim 64 by CTAs of three consumers (192 rows, the default) and of two
    (forced; the kernel before them): output, lse and gradients against float64, rows
    a multiple of 192 and a ragged tail, GQA."""
    if num_consumers == 2:
        force_config_fields(monkeypatch, fwd, "forward_config", num_consumers=2)
    configs = record_configs(monkeypatch, fwd, "attention_forward")
    check_case("mosaic", Case("dense_head_dim_64", batch=2, q_len=q_len, kv_len=1024, heads=4,
                              kv_heads=2, head_dim=64), "bfloat16", (128, 128), block_rows=32)
    assert {c.num_consumers for c in configs} == {num_consumers}


@pytest.fixture(params=["sm90", "sm100"])
def _interpreted_architecture(request, monkeypatch):
    """Interpreted kernels (races fail) of each architecture; its name."""
    if request.param == "sm100":
        skip_unless_blackwell_interpreter()
    for _ in interpreted_mosaic(monkeypatch, request.param):
        yield request.param


@pytest.mark.interpreted
@pytest.mark.parametrize("deterministic", [True, False])
def test_sectioned_launch_with_a_short_last_section_interpreted(deterministic, monkeypatch,
                                                                _interpreted_architecture):
    """The sectioned launch order (`attention_sm90_common.sectioned_launch`) with 6 SMs:
    sections of two or three of 5 heads, the last one short, in the forward and backward
    kernels of both architectures (on sm90 the dQ kernel, or deterministic=False the
    fused dQ's two launches), under a ragged causal mask, against float64."""
    monkeypatch.setattr(runtime, "num_sms", lambda: 6)
    if _interpreted_architecture == "sm90":
        force_config_fields(monkeypatch, fwd, "forward_config", q_blocks_per_cta=1)
        force_config_fields(monkeypatch, bwd, "backward_config", fused_dq_min_full_walk=0.0)
    positions, accumulating = [], []
    sectioned = common.sectioned_position
    monkeypatch.setattr(common, "sectioned_position",
                        lambda *args: positions.append(args[1:]) or sectioned(*args))
    kernel = compat.mosaic_kernel_accumulating
    monkeypatch.setattr(compat, "mosaic_kernel_accumulating",
                        lambda *args, **kwargs: accumulating.append(1) or kernel(*args, **kwargs))
    case = Case("causal_ragged_five_heads", batch=1, q_len=300, kv_len=330, heads=5,
                kv_heads=5, head_dim=64, is_causal=True, deterministic=deterministic)
    check_case("mosaic", case, "bfloat16", (128, 128), block_rows=32)
    # (heads, CTAs a head, heads a section): the forward, then the backward's launches.
    assert len(positions) >= 3, positions
    assert all(heads == 5 and section in (2, 3) for heads, _, section in positions), positions
    if _interpreted_architecture == "sm90":
        assert set(positions) == {(5, 3, 2)}, positions
        assert len(accumulating) == (0 if deterministic else 2), accumulating


@pytest.mark.interpreted
def test_a_cta_reloads_its_walk_buffers_interpreted(monkeypatch, _interpreted):
    """Three row blocks in one forward CTA under a block mask whose walks the producer
    reads from shared memory: the third row block's walk overwrites the first one's
    buffer by TMA after the producer read it (a race on jax 0.12 without a proxy fence)."""
    force_config_fields(monkeypatch, fwd, "forward_config", q_blocks_per_cta=4)
    configs = record_configs(monkeypatch, fwd, "attention_forward")
    case = Case("chunked_three_row_blocks", batch=1, q_len=348, kv_len=154, heads=2,
                kv_heads=1, head_dim=64, block_mask="chunked")
    check_case("mosaic", case, "bfloat16", (128, 64), block_rows=32)
    assert configs and all(c.q_blocks_per_cta == 4 for c in configs)


_SPLIT_CASES = ("decode_step_gqa_sinks", "causal_ragged", "generic_block_mask_and_causal")


@pytest.mark.interpreted
@pytest.mark.parametrize("case", [c for c in CASES if c.name in _SPLIT_CASES],
                         ids=lambda case: case.name)
def test_kv_splits_interpreted(case, monkeypatch, _interpreted):
    """Every q-block's walk in three shares, one CTA each, combined by the wrapper
    (`ForwardConfig.kv_splits`): uneven and empty shares, FULL and masked steps split
    apart, stored tiles; gradients from the combined output and lse."""
    force_config_fields(monkeypatch, fwd, "forward_config", kv_splits=3, q_blocks_per_cta=1)
    check_case("mosaic", case, "bfloat16", (128, 64), block_rows=32)


@pytest.mark.gpu
@pytest.mark.skipif(runtime.interpret_requested() or runtime.gpu_compute_capability() != (9, 0),
                    reason="needs an sm90 GPU (compiled Mosaic-GPU kernels)")
@pytest.mark.parametrize("kv_splits", [None, 3])
@pytest.mark.parametrize("case", [
    *(c for c in GPU_CASES if c.name in _SPLIT_CASES),
    # The default splits of a decoding step at head dim 128: 4 query heads of each of 2
    # kv heads packed into 4 rows, a cache of 5000 (40 kv-blocks) in 5 shares.
    Case("decode_long_cache_head_dim_128", batch=1, q_len=1, kv_len=5000, heads=8,
         kv_heads=2, head_dim=128, block_mask="decode", sinks=True),
], ids=lambda case: case.name)
def test_kv_splits_compiled(case, kv_splits, monkeypatch):
    if kv_splits is not None:
        force_config_fields(monkeypatch, fwd, "forward_config", kv_splits=kv_splits,
                            q_blocks_per_cta=1)
    check_case("mosaic", case, "bfloat16", (128, 128), block_rows=32)
