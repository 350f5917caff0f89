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
from pallas_kernels.paged import PagedScores
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


def test_kv_splits_combine(mode, monkeypatch, seed):
    """Split-KV (what a GPU with idle SMs takes for long caches), forced here on a short
    one: three CTAs per q-block, each walking a share of its kv-blocks, one share empty."""
    from pallas_kernels import kv_splits

    monkeypatch.setattr(kv_splits, "num_splits", lambda *args: 3)
    configs = record_configs(monkeypatch, fwd, "attention_forward")
    jax.clear_caches()  # a trace of the same call would skip the patched choice
    _check(_case(seed, kv_lens=[300, 140], heads=4, kv_heads=2, page_size=32),
           dict(local_window_size=(200, 0)))
    assert [c.kv_splits for c in configs] == [3]


# name: (kv_lens, q_len, group, page_size, pages_per_seq, block_kv, is_causal, window).
WALK_CASES = {
    "decode_gqa": ([0, 1, 700, 1024, 333], 1, 4, 16, 64, 128, True, None),
    "decode_ragged_table": ([5, 200, 999], 1, 8, 16, 63, 64, True, None),
    "prefill_chunk": ([300, 900, 2048], 40, 4, 64, 32, 128, True, None),
    "window": ([1000, 90, 2000], 33, 1, 32, 64, 64, True, (300, 0)),
    "not_causal_window": ([1000, 700], 50, 2, 64, 16, 128, False, (200, 100)),
    "not_causal": ([0, 130, 511], 3, 4, 128, 4, 128, False, None),
}


def _tile_visibility(lens, table, num_pages, scores, *, group, rows, page_size, block_kv,
                     num_q_blocks, num_kv_blocks):
    """(any, all) keys visible per (sequence, packed q-block, kv-block) tile, in numpy
    from `PagedScores.visible` and the page ids: what a walk must cover and may call FULL."""
    padded_rows, padded_keys = num_q_blocks * fwd.BLOCK_Q, num_kv_blocks * block_kv
    q_pos = np.asarray(scores.query_position(np.asarray(lens)[:, None],
                                             np.arange(rows)[None] // group))  # [B, R]
    k_pos = np.arange(padded_keys)
    slot = np.minimum(k_pos // page_size, table.shape[1] - 1)
    real = (table[:, slot] >= 0) & (table[:, slot] < num_pages) & (
        k_pos < table.shape[1] * page_size)
    seen = np.asarray(scores.visible(jnp.asarray(q_pos[:, :, None]), k_pos[None, None, :],
                                     jnp.asarray(lens)[:, None, None])) & real[:, None, :]
    tiles = np.zeros((len(lens), padded_rows, padded_keys), bool)
    valid = np.zeros_like(tiles)
    tiles[:, :rows] = seen
    valid[:, :rows] = True
    shape = (len(lens), num_q_blocks, fwd.BLOCK_Q, num_kv_blocks, block_kv)
    tiles, valid = tiles.reshape(shape), valid.reshape(shape)
    return tiles.any(axis=(2, 4)), (tiles | ~valid).all(axis=(2, 4))


@pytest.mark.parametrize("bad_ids", [False, True])
@pytest.mark.parametrize("name", WALK_CASES)
def test_closed_form_walk_covers_the_visible_tiles(name, bad_ids, seed):
    """The paged kernel's walks (built per call in closed form, `mosaic._kernel_mask`)
    hold exactly the tiles with a visible key, FULL ones (all keys visible) first. With
    page ids outside the cache in use, such a sequence's tiles are all COMPUTED."""
    kv_lens, q_len, group, page_size, pages_per_seq, block_kv, causal, window = WALK_CASES[name]
    rng = np.random.default_rng(seed)
    batch, num_pages = len(kv_lens), 4 * pages_per_seq
    table = rng.integers(0, num_pages, (batch, pages_per_seq), dtype=np.int32)
    lens = np.asarray(kv_lens, np.int32)
    if bad_ids:  # the first page of the longest sequence, the last of the last one
        table[np.argmax(lens), 0], table[-1, (lens[-1] - 1) // page_size] = num_pages, -1
    scores = PagedScores(q_len=q_len, is_causal=causal, window=window, softcap=None,
                         scale=1.0)
    rows = q_len * group
    kmask, layout = mosaic._kernel_mask(jnp.asarray(lens), jnp.asarray(table), num_pages,
                                        scores, group=group, rows=rows, page_size=page_size,
                                        block_kv=block_kv)
    assert layout.num_q_blocks == -(-rows // fwd.BLOCK_Q)
    assert layout.num_kv_blocks == -(-pages_per_seq * page_size // block_kv)
    any_seen, all_seen = _tile_visibility(
        lens, table, num_pages, scores, group=group, rows=rows, page_size=page_size,
        block_kv=block_kv, num_q_blocks=layout.num_q_blocks,
        num_kv_blocks=layout.num_kv_blocks)
    count, num_full = np.asarray(kmask.kv_num_blocks), np.asarray(kmask.kv_num_full)
    indices, flags = np.asarray(kmask.kv_indices), np.asarray(kmask.kv_tile_flags)
    in_use = np.arange(pages_per_seq)[None] * page_size < lens[:, None]
    has_bad = (((table < 0) | (table >= num_pages)) & in_use).any(axis=1)
    assert has_bad.any() == bad_ids
    for b in range(batch):
        for i in range(layout.num_q_blocks):
            walk = indices[b, 0, i, :count[b, 0, i]]
            full = walk[:num_full[b, 0, i]]
            assert len(set(walk)) == len(walk)
            assert (flags[b, 0, i, :count[b, 0, i]] == np.where(
                np.arange(len(walk)) < len(full), 0, 1)).all()
            assert set(np.flatnonzero(any_seen[b, i])) <= set(walk)
            if has_bad[b]:
                assert len(full) == 0
                continue
            assert set(walk) == set(np.flatnonzero(any_seen[b, i]))
            assert set(full) == set(np.flatnonzero(all_seen[b, i] & any_seen[b, i]))


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
DECODE_STEPS = [(8, 8192, 16, 2), (64, 4096, 64, 1), (1, 131072, 64, 16)]


@pytest.mark.parametrize("batch,kv_len,page_size,splits", DECODE_STEPS)
def test_decoding_step_computes_little_around_the_kernel(monkeypatch, batch, kv_len, page_size,
                                                         splits):
    """Each XLA op around a decoding step's kernel can be a launch of its own (2-4 us on
    a 0.1 ms step). Pinned: the kernel reads q (packed heads first), K, V and the page
    table (whole lines, or one short row) as they come (the producer clamps page ids),
    its mask's one leaf (the keys' sequence lengths) is computed by its producer (no
    array), the walks need one reduction (the page check) and the kv-split combine none.
    Compiled by XLA (on CPU here), the step computes before the kernel only the walks
    (the page check included); after it nothing without kv splits (the output is a view
    of the kernel's), with them the combine."""
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
    assert reductions == ["reduce_and"]
    after = eqns[eqns.index(kernel) + 1:]
    assert not [e for e in after if e.primitive.name.startswith("reduce")]

    entry = _entry_ops(jax.jit(step).lower(*args).compile().as_text())
    ops = list(entry)
    (call,) = [op for op in ops if entry[op][0] == "custom-call"]
    q, k, v, walk, table = (_source(entry, op) for op in entry[call][1])
    assert [entry[x][0] for x in (q, k, v, table)] == ["parameter"] * 4  # views, no copy
    before = {op for op in ops[:ops.index(call)] if _work(entry, op)}
    # Only the walks: the page check and their pieces, which XLA on the GPU fuses with
    # their concatenate (on CPU apart).
    assert before == _upstream(entry, walk)
    after = [op for op in ops[ops.index(call) + 1:] if _work(entry, op)]
    # The combine: the total lse, the shares' weights, their weighted sum in the output
    # layout (and with jax 0.10's XLA the shares' outputs converted to float32 apart).
    assert len(after) <= (0 if splits == 1 else 4)
