"""`omni_jax.paged_attention(..., implementation="mosaic")` against float64: the Mosaic-GPU
forward with paged K/V, interpreted on any machine (a race found fails the test) and
compiled on an sm90 GPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax
from omni_jax.paged import mosaic
from pallas_kernels import runtime
from pallas_kernels.mosaic import attention_fwd_sm90 as fwd
from tests.forced_configs import record_configs
from tests.mosaic_interpret import interpreted_mosaic
from tests.omni_jax.paged.paged_reference import dense_paged_reference, random_case
from tests.reference import relative_error

TOLERANCE = 2e-2  # bfloat16
_ON_HOPPER = runtime.gpu_compute_capability() == (9, 0)

# name: (random_case arguments, paged_attention arguments). Head dim 64, bfloat16; pages
# of 16 (four per 64-key tile: a TMA each) and 64 (one tile, one TMA).
CASES = {
    "decode_ragged_gqa": (dict(kv_lens=[0, 37, 80], heads=8, kv_heads=2), {}),
    "prefill_chunk_pages_64": (dict(kv_lens=[150, 5], q_len=3, page_size=64,
                                    pages_per_seq=3), {}),
    "window_softcap_unpacked_group": (dict(kv_lens=[90, 33], q_len=2, heads=3, kv_heads=1),
                                      dict(local_window_size=(20, 0), softcap=2.0)),
    "not_causal_window_both_sides": (dict(kv_lens=[70, 100], q_len=4, page_size=64),
                                     dict(is_causal=False, local_window_size=(30, 5))),
    # Sides past int32: the walks' key ranges must not overflow positions.
    "not_causal_window_beyond_int32": (dict(kv_lens=[70, 100], q_len=4, page_size=64),
                                       dict(is_causal=False, local_window_size=(2**40, 2**40))),
    # A table row of 12 ids, read as it is into the start of the producer's line (the
    # last kv-block's pages 12-15 lie past it).
    "decode_gqa_short_table": (dict(kv_lens=[60, 190], heads=8, kv_heads=2,
                                    pages_per_seq=12), {}),
}


@pytest.fixture(params=[
    pytest.param("interpreted", marks=pytest.mark.interpreted),
    pytest.param("compiled", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not _ON_HOPPER, reason="needs an sm90 GPU")]),
])
def mode(request, monkeypatch):
    """The kernel interpreted (races fail the test) or compiled on Hopper."""
    if request.param == "interpreted":
        yield from interpreted_mosaic(monkeypatch)
        runtime.reset_mosaic_interpreter()
    else:
        yield


def _case(seed, **kwargs):
    return random_case(seed, head_dim=64, dtype=jnp.bfloat16, **kwargs)


def _check(case, kwargs, *, sinks=None, call=omni_jax.paged_attention):
    out, lse = call(case.q, case.k_pages, case.v_pages, case.page_table, case.kv_lens,
                    sinks=sinks, return_lse=True, implementation="mosaic", **kwargs)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    with jax.enable_x64(True):
        ref_out, ref_lse = dense_paged_reference(
            case, is_causal=kwargs.get("is_causal", True),
            window=kwargs.get("local_window_size"), softcap=kwargs.get("softcap"),
            sinks=sinks)
    assert relative_error(out, ref_out) < TOLERANCE
    finite = np.isfinite(np.asarray(ref_lse))
    assert (np.isfinite(np.asarray(lse)) == finite).all()
    assert relative_error(np.asarray(lse)[finite], np.asarray(ref_lse)[finite]) < 1e-3
    return out, lse


@pytest.mark.parametrize("name", CASES)
def test_matches_dense_reference(name, mode, seed):
    case_args, kwargs = CASES[name]
    out, lse = _check(_case(seed, **case_args), kwargs)
    empty = np.asarray(case_args["kv_lens"]) == 0
    assert (np.asarray(out, np.float32)[empty] == 0).all()
    assert np.isneginf(np.asarray(lse)[empty]).all()


@pytest.mark.smoke
def test_gqa_sinks_under_jit(mode, seed):
    case = _case(seed, kv_lens=[75, 0, 19], q_len=2, heads=8, kv_heads=2)
    sinks = jax.random.normal(jax.random.key(seed + 1), (8,), jnp.float32)
    _check(case, {}, sinks=sinks,
           call=jax.jit(omni_jax.paged_attention,
                        static_argnames=("return_lse", "implementation")))


@pytest.mark.parametrize("page_size", [16, 64])
def test_bad_page_ids_under_jit_are_masked_not_read(mode, page_size, seed):
    """Ids outside the cache for tokens in use (no concrete check under jit) contribute
    nothing: the result is the reference with those tokens' pages left out of the
    sequence (here: their keys moved past kv_len by a shorter, equivalent cache)."""
    case = _case(seed, kv_lens=[2 * page_size, 2 * page_size], page_size=page_size,
                 spare_pages=0)
    bad = case.page_table.at[0, 0].set(10_000).at[1, 1].set(-7)
    out = jax.jit(lambda *a: omni_jax.paged_attention(*a, implementation="mosaic"))(
        case.q, case.k_pages, case.v_pages, bad, case.kv_lens)
    # Each sequence keeps one good page: its reference is that page alone.
    good = case.page_table[:, ::-1].at[1].set(case.page_table[1])
    kept = case.__class__(case.q, case.k_pages, case.v_pages, good,
                          jnp.array([page_size, page_size], jnp.int32))
    with jax.enable_x64(True):
        ref_out, _ = dense_paged_reference(kept, is_causal=False)
    assert relative_error(out, ref_out) < TOLERANCE


def test_lengths_past_the_table_under_jit_keep_their_positions(mode, seed):
    """A length past the table's pages (garbage under jit, unchecked) reads no key past
    the table, and the query keeps its position: with a window, it sees the table's last
    tokens within the window of its own position (a walk taking the table's end as the
    length would call the tiles of that shifted window FULL)."""
    window = 200
    case = _case(seed, kv_lens=[512, 512], spare_pages=0)
    too_long = [700, 560]
    out = jax.jit(lambda *a: omni_jax.paged_attention(
        *a, local_window_size=(window, 0), implementation="mosaic"))(
        case.q, case.k_pages, case.v_pages, case.page_table, jnp.array(too_long, jnp.int32))
    for b, length in enumerate(too_long):
        # The same keys as a query at the table's end with a window reaching as far back.
        one = case.__class__(case.q[b:b + 1], case.k_pages, case.v_pages,
                             case.page_table[b:b + 1], jnp.array([512], jnp.int32))
        with jax.enable_x64(True):
            ref_out, _ = dense_paged_reference(one, window=(512 - length + window, 0))
        assert relative_error(out[b:b + 1], ref_out) < TOLERANCE


def test_kv_splits_combine(mode, monkeypatch, seed):
    """Split-KV (what a GPU with idle SMs takes for long caches), forced here on a short
    one: three CTAs per q-block, each walking a share of its kv-blocks, one share empty."""
    from pallas_kernels import kv_splits

    monkeypatch.setattr(kv_splits, "num_splits", lambda *args, **kwargs: 3)
    configs = record_configs(monkeypatch, fwd, "attention_forward")
    jax.clear_caches()  # a trace of the same call would skip the patched choice
    _check(_case(seed, kv_lens=[300, 140], heads=4, kv_heads=2, page_size=32),
           dict(local_window_size=(200, 0)))
    assert [c.kv_splits for c in configs] == [3]


def test_config_overrides_choose_splits_by_their_block_kv(monkeypatch):
    """A benchmark's forced fields (`backends.forward`'s overrides) replace the tuned ones;
    the kv splits follow a forced block_kv (twice the kv-blocks, up to filling the SMs)."""
    monkeypatch.setattr(runtime, "num_sms", lambda: 132)
    call = mosaic._Call(128, 128, np.dtype(jnp.bfloat16), True)
    tuned = mosaic._config(call, 8, 4096)
    assert (tuned.block_kv, tuned.kv_splits) == (128, 4)  # 32 kv-blocks, 8 steps a share
    forced = mosaic._config(call, 8, 4096, {"block_kv": 64, "num_stages": 4, "pipelined": 0})
    assert (forced.block_kv, forced.num_stages, forced.kv_splits) == (64, 4, 8)
    assert forced.pipelined is False
    assert mosaic._config(call, 8, 4096, {"kv_splits": 1}).kv_splits == 1
    head_dim_64 = mosaic._Call(64, 64, np.dtype(jnp.bfloat16), True)  # 4 q-blocks a CTA
    forced = mosaic._config(head_dim_64, 512, 512, {"kv_splits": 2})
    assert (forced.kv_splits, forced.q_blocks_per_cta) == (2, 1)


@pytest.mark.parametrize("batch,programs,kv_len,splits", [
    (8, 64, 32768, 4),  # 8 sequences x 8 kv heads: two waves of 132 SMs
    (16, 128, 8192, 2),
    (1, 8, 131072, 16),  # one sequence: one wave (its walks are as long as each other)
    (32, 256, 16384, 1),
])
def test_batches_split_their_walks_for_several_waves(monkeypatch, batch, programs, kv_len,
                                                     splits):
    """A batch's lengths are known only on the device: its kv splits fill
    `mosaic.RAGGED_WAVES` waves of CTAs, a single sequence's one."""
    monkeypatch.setattr(runtime, "num_sms", lambda: 132)
    call = mosaic._Call(128, 128, np.dtype(jnp.bfloat16), True)
    assert mosaic._config(call, programs, kv_len, batch=batch).kv_splits == splits


def _eqns(jaxpr) -> list:
    """The equations of ``jaxpr`` with every nested jit/custom_jvp body inlined."""
    eqns = []
    for eqn in jaxpr.eqns:
        body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        eqns += _eqns(getattr(body, "jaxpr", body)) if body is not None else [eqn]
    return eqns


def _producers(eqns, var) -> list[str]:
    """Primitives of every equation that ``var`` is computed from (down to the inputs)."""
    by_output = {id(out): eqn for eqn in eqns for out in eqn.outvars}
    names, stack = [], [var]
    while stack:
        eqn = by_output.get(id(stack.pop()))
        if eqn is not None:
            names.append(eqn.primitive.name)
            stack += eqn.invars
    return names


_HLO_OP = re.compile(r"^\s*(?:ROOT )?(%[\w.-]+) = .*?[\]}\)] ([a-z][\w-]*)\((.*?)\)")
# Ops that compute nothing: views, tuples, inputs.
_NO_WORK = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple"}


def _entry_ops(hlo: str) -> dict[str, tuple[str, list[str], set[str]]]:
    """The ENTRY computation of compiled HLO text, in order: op name -> (opcode, operand
    names, the opcodes inside it when it is a fusion)."""
    bodies, name, entry = {}, None, {}
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = "ENTRY" if line.startswith("ENTRY") else line.split()[0]
            bodies[name] = []
        elif name and (match := _HLO_OP.match(line)):
            bodies[name].append(match.groups())
    for op, opcode, operands in bodies["ENTRY"]:
        called = re.search(r"calls=(%[\w.-]+)", next(
            line for line in hlo.splitlines() if f"{op} = " in line))
        inner = {o for _, o, _ in bodies.get(called.group(1), [])} if called else set()
        entry[op] = (opcode, re.findall(r"%[\w.-]+", operands), inner)
    return entry


def _work(entry, op) -> bool:
    """Whether ``op`` moves or computes data (a fusion of bitcasts and copies alone does
    not: XLA on CPU copies a pure_callback result that the step returns, even a view)."""
    opcode, _, inner = entry[op]
    return opcode not in _NO_WORK and not (opcode == "fusion"
                                           and inner <= {"parameter", "bitcast", "copy"})


def _source(entry, op) -> str:
    """``op`` seen through views (bitcasts)."""
    while entry[op][0] == "bitcast":
        op = entry[op][1][0]
    return op


def _upstream(entry, op) -> set[str]:
    """The ops that do work (`_work`) among ``op`` and what it is computed from."""
    found, stack = set(), [op]
    while stack:
        op = stack.pop()
        if op not in found and op in entry:
            found.add(op)
            stack += entry[op][1]
    return {op for op in found if _work(entry, op)}


# (batch, kv_len, page_size, splits): the decoding shapes of issue 49's ncu kernel lists.
DECODE_STEPS = [(8, 8192, 16, 4), (64, 4096, 64, 1), (1, 131072, 64, 16)]


@pytest.mark.parametrize("batch,kv_len,page_size,splits", DECODE_STEPS)
def test_decoding_step_computes_little_around_the_kernel(monkeypatch, batch, kv_len, page_size,
                                                         splits):
    """Each XLA op around a decoding step's kernel can be a launch of its own (2-4 us on
    a 0.1 ms step). Pinned: the kernel reads q (packed heads first), K, V and the page
    table (whole lines, or one short row) as they come (the producer clamps page ids),
    its mask's one leaf (the keys' sequence lengths) is computed by its producer (no
    array), as are its walks (from each sequence's length and page check: one reduction,
    `walk_seeds`), and the kv-split combine needs none. Compiled by XLA (on CPU here), the
    step computes before the kernel only those seeds; after it nothing without kv splits
    (the output is a view of the kernel's), with them the combine."""
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    monkeypatch.setattr(runtime, "num_sms", lambda: 132)

    def kernel_stub(body, out_type, **kwargs):
        return lambda *operands: jax.pure_callback(
            lambda *_: tuple(np.zeros(o.shape, o.dtype) for o in out_type), tuple(out_type),
            *operands)

    monkeypatch.setattr(fwd.compat, "mosaic_kernel", kernel_stub)
    pages = kv_len // page_size
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
        ((batch, 1, 32, 128), jnp.bfloat16), ((batch * pages, page_size, 8, 128), jnp.bfloat16),
        ((batch * pages, page_size, 8, 128), jnp.bfloat16), ((batch, pages), jnp.int32),
        ((batch,), jnp.int32))]
    step = lambda *a: omni_jax.paged_attention(*a, implementation="mosaic")
    jaxpr = jax.make_jaxpr(step)(*args)
    eqns = _eqns(jaxpr.jaxpr)
    (kernel,) = [e for e in eqns if e.primitive.name == "pure_callback"]
    assert kernel.outvars[1].aval.shape[0] == splits
    q, k, v, walk, table = kernel.invars  # no other operand
    assert set(_producers(eqns, k)) | set(_producers(eqns, v)) <= {"reshape"}
    assert set(_producers(eqns, table)) <= {"reshape", "convert_element_type"}
    before = eqns[:eqns.index(kernel)]
    reductions = [e.primitive.name for e in before if e.primitive.name.startswith("reduce")]
    assert reductions == ["reduce_min"]
    after = eqns[eqns.index(kernel) + 1:]
    assert not [e for e in after if e.primitive.name.startswith("reduce")]

    entry = _entry_ops(jax.jit(step).lower(*args).compile().as_text())
    ops = list(entry)
    (call,) = [op for op in ops if entry[op][0] == "custom-call"]
    q, k, v, walk, table = (_source(entry, op) for op in entry[call][1])
    assert [entry[x][0] for x in (q, k, v, table)] == ["parameter"] * 4  # views, no copy
    before = {op for op in ops[:ops.index(call)] if _work(entry, op)}
    # Only the walks' seeds (XLA on CPU splits the reduction in two or three).
    assert before == _upstream(entry, walk)
    assert len(before) <= 4
    after = [op for op in ops[ops.index(call) + 1:] if _work(entry, op)]
    # The combine: the total lse, the shares' weights, their weighted sum in the output
    # layout (and with jax 0.10's XLA the shares' outputs converted to float32 apart).
    assert len(after) <= (0 if splits == 1 else 4)
