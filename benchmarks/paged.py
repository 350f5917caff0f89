"""Paged KV-cache attention: decoding steps and prefill chunks over pages, beside peers.

    python -m benchmarks paged            # H100: GQA (32 query, 8 kv heads), d128, bf16
    python -m benchmarks paged --tiny     # CPU smoke test

Each shape is ``batch,q_len,kv_len,q_heads,kv_heads,head_dim,page_size,lengths`` with
lengths "uniform" (every sequence kv_len tokens) or "ragged" (uniform in
[kv_len / 8, kv_len]); pages are shuffled through the cache. Every implementation's
output is checked against omni_jax's XLA reference (in float32) before it is timed;
one that disagrees is reported, not timed. Peers run where importable:
``fa3`` (flash_attn3_jax.flash_mha_with_kvcache with the page table), ``jax_pallas``
(jax.experimental.pallas.ops.gpu.paged_attention, decoding steps only), ``cudnn``
(jax.nn.dot_product_attention on the equivalent contiguous cache, gathered outside the
timing). ``copy`` copies the K/V pages: the bandwidth the device sustains, the bound of
a decoding step. ``ratio`` = fa3 ms / this row's ms (cudnn's, then XLA's, where fa3 is
absent); the note gives the K/V bytes in use read per second.

Config knobs for an A/B in one run: ``omni_mosaic/FIELD=N/...`` forces fields of the
Mosaic forward's `ForwardConfig` (block_kv, num_stages, kv_splits, pipelined, ...),
``omni_triton/FIELD=N/...`` those of the Triton kernel's `PagedConfig` (block_rows,
block_kv, num_warps, num_stages, kv_splits, programs_per_sm), over the call's default
choice:

    python -m benchmarks paged --impls omni_mosaic omni_mosaic/block_kv=64/num_stages=4 fa3
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import omni_jax
from benchmarks import report
from benchmarks.timing import add_run_arguments, bench_interleaved, tflops, timing_options
from omni_jax.paged import backends
from pallas_kernels import runtime
from pallas_kernels.mosaic.attention_fwd_sm90 import ForwardConfig
from pallas_kernels.paged import PagedScores
from pallas_kernels.triton.paged_attention import PagedConfig

SHAPES = tuple(
    f"{batch},1,{kv_len},32,8,128,{page},{lengths}"
    for batch, kv_len in ((1, 131072), (8, 32768), (64, 4096), (256, 512))
    for page in (16, 64) for lengths in ("uniform", "ragged")
) + tuple(f"1,{q_len},{kv_len},32,8,128,{page},uniform" for q_len, kv_len in
          ((128, 2048), (512, 8192), (2048, 32768)) for page in (16, 64))
TINY_SHAPES = ("2,1,200,8,2,32,16,ragged", "1,4,64,4,1,32,8,uniform")
IMPLS = ("omni", "omni_mosaic", "omni_triton", "omni_xla", "fa3", "jax_pallas", "cudnn", "copy")
BASELINES = ("fa3", "cudnn", "omni_xla")
TOLERANCE = 2e-2  # relative error against the float32 reference (bfloat16 inputs)
# ``--impls`` names that force config fields: prefix -> the config class.
FORCED_CONFIGS = {"omni_mosaic/": ForwardConfig, "omni_triton/": PagedConfig}


def forced_fields(impl: str) -> tuple[str, dict[str, int]] | None:
    """(backend, {field: value}) of an ``omni_mosaic/FIELD=N/...`` or
    ``omni_triton/FIELD=N/...`` name, None for any other name; a bad field raises."""
    prefix = next((p for p in FORCED_CONFIGS if impl.startswith(p)), None)
    if prefix is None:
        return None
    names = {field.name for field in dataclasses.fields(FORCED_CONFIGS[prefix])}
    fields = {}
    for item in impl[len(prefix):].split("/"):
        name, _, value = item.partition("=")
        if name not in names or not value.isdigit():
            raise ValueError(f"{impl!r}: expected FIELD=N with FIELD one of {sorted(names)}, "
                             f"got {item!r}")
        fields[name] = int(value)
    return prefix.removeprefix("omni_").removesuffix("/"), fields


def _check_impl(impl: str) -> str:
    if impl not in IMPLS and forced_fields(impl) is None:
        raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}, "
                         f"omni_mosaic/FIELD=N/... or omni_triton/FIELD=N/...")
    return impl


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES),
                        help="batch,q_len,kv_len,q_heads,kv_heads,head_dim,page_size,"
                             "uniform|ragged per shape")
    add_run_arguments(parser, impls=IMPLS, tiny=f"tiny shapes: {' '.join(TINY_SHAPES)}",
                      check=_check_impl,
                      choices=f"{', '.join(IMPLS)}, omni_mosaic/FIELD=N/... or "
                              f"omni_triton/FIELD=N/...")


def _shape(text: str) -> tuple:
    parts = text.split(",")
    if len(parts) != 8 or parts[7] not in ("uniform", "ragged"):
        raise ValueError(f"a shape is batch,q_len,kv_len,q_heads,kv_heads,head_dim,page_size,"
                         f"uniform|ragged; got {text!r}")
    sizes = tuple(int(x) for x in parts[:7])
    if sizes[3] % sizes[4]:
        raise ValueError(f"q_heads must be a multiple of kv_heads; got {text!r}")
    return (*sizes, parts[7])


def _inputs(batch, q_len, kv_len, heads, kv_heads, dim, page_size, lengths, dtype):
    """(q, k_pages, v_pages, page_table, kv_lens): each sequence on its own shuffled pages."""
    rng = np.random.default_rng(0)
    pages_per_seq = -(-kv_len // page_size)
    lens = (np.full(batch, kv_len) if lengths == "uniform"
            else rng.integers(max(q_len, kv_len // 8), kv_len + 1, batch))
    table = rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq)
    keys = jax.random.split(jax.random.key(0), 3)
    pages_shape = (batch * pages_per_seq, page_size, kv_heads, dim)
    return (jax.random.normal(keys[0], (batch, q_len, heads, dim), dtype),
            jax.random.normal(keys[1], pages_shape, dtype),
            jax.random.normal(keys[2], pages_shape, dtype),
            jnp.asarray(table, jnp.int32), jnp.asarray(lens, jnp.int32))


def _contiguous(k_pages, page_table):
    """The pages of each sequence in order: ``[batch, pages_per_seq * page_size, ...]``."""
    batch = page_table.shape[0]
    return k_pages[page_table].reshape(batch, -1, *k_pages.shape[2:])


def _fa3_splits(batch: int, kv_heads: int, cache_len: int) -> int:
    """kv splits for FA3's kernel, which flash_attn3_jax makes the caller choose (at least 1):
    enough (batch, kv head) programs to fill the SMs in one wave, each share at least 512
    tokens long, at most 16 (the values its docstring suggests)."""
    fill = -(-runtime.num_sms() // (batch * kv_heads))
    return max(1, min(16, fill, cache_len // 512))


def _function(impl: str, args: tuple):
    """(the timed function, the arguments it takes), or a string saying why there is none."""
    q, k_pages, v_pages, page_table, kv_lens = args
    q_len, dim = q.shape[1], q.shape[3]
    forced = forced_fields(impl)
    if forced is not None:
        backend, fields = forced
        scores = PagedScores(q_len=q_len, is_causal=True, window=None, softcap=None,
                             scale=dim ** -0.5)
        # The API's call without its trace-time checks: one kernel, the overrides on it.
        return jax.jit(lambda *a: backends.forward(
            backend, *a, scores, interpret=runtime.interpret_requested(),
            overrides=fields)[0]), args
    if impl.startswith("omni"):
        backend = None if impl == "omni" else impl.removeprefix("omni_")
        return jax.jit(lambda *a: omni_jax.paged_attention(*a, implementation=backend)), args
    if impl == "copy":
        return jax.jit(lambda k, v: (k + 0, v + 0)), (k_pages, v_pages)
    if impl == "cudnn":
        k, v = _contiguous(k_pages, page_table), _contiguous(v_pages, page_table)
        q_pos = kv_lens[:, None] - q_len + jnp.arange(q_len)
        mask = jnp.arange(k.shape[1])[None, None, :] <= q_pos[:, :, None]  # so < kv_len too
        return jax.jit(lambda q, k, v, mask: jax.nn.dot_product_attention(
            q, k, v, mask=mask[:, None], implementation="cudnn")), (q, k, v, mask)
    if impl == "fa3":
        try:
            from flash_attn3_jax import flash_mha_with_kvcache
        except ImportError:
            return "flash_attn3_jax is not installed"
        splits = _fa3_splits(q.shape[0], k_pages.shape[2], page_table.shape[1] * k_pages.shape[1])
        return jax.jit(lambda q, k, v, table, lens: flash_mha_with_kvcache(
            q, k, v, cache_seqlens=lens, page_table=table, is_causal=True,
            num_splits=splits)), args
    assert impl == "jax_pallas"
    if q_len != 1:
        return "decoding steps only (q_len 1)"
    try:
        with warnings.catch_warnings():  # deprecated in jax 0.12, gone by 0.12.1
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    except ImportError:
        return "jax.experimental.pallas.ops.gpu.paged_attention is not importable"
    heads_first = (jnp.moveaxis(k_pages, 2, 0), jnp.moveaxis(v_pages, 2, 0))
    # Its table splits into k_splits partitions of whole compute blocks of pages: pad it
    # (the lengths mask the padding).
    block = 8
    splits = min(16, -(-page_table.shape[1] // block))
    padded = -(-page_table.shape[1] // (block * splits)) * block * splits
    table = jnp.pad(page_table, ((0, 0), (0, padded - page_table.shape[1])))

    def pallas(q, k, v, table, lens):
        out = paged_attention(q[:, 0] * dim ** -0.5, k, v, table, lens,
                              pages_per_compute_block=block, k_splits=splits,
                              interpret=jax.default_backend() != "gpu")
        return out[:, None]

    return jax.jit(pallas), (q, *heads_first, table, kv_lens)


def _check(fn, fn_args, expected) -> str | None:
    """Why ``fn``'s output is wrong, or None when it matches the reference."""
    out = fn(*fn_args)
    out = out[0] if isinstance(out, tuple) else out
    out = np.asarray(out, np.float32)
    if out.shape != expected.shape:
        return f"output shape {out.shape}, expected {expected.shape}"
    error = np.linalg.norm(out - expected) / np.linalg.norm(expected)
    if not error < TOLERANCE:  # NaN fails too
        return f"relative error {error:.3g} against the reference"
    return None


def run(args: argparse.Namespace) -> list[dict]:
    shapes = [_shape(s) for s in (TINY_SHAPES if args.tiny else args.shapes)]
    timing = timing_options(args)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    rows = []
    for shape in shapes:
        batch, q_len, kv_len, heads, kv_heads, dim, page_size, lengths = shape
        inputs = _inputs(*shape, dtype)
        as_f32 = [x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
                  for x in inputs]
        expected = np.asarray(omni_jax.paged_attention(*as_f32, implementation="xla"))
        case = (f"b={batch} q={q_len} kv={kv_len} {lengths} h={heads}/{kv_heads} d={dim} "
                f"page={page_size}")
        notes, fns = {}, {}
        for impl in args.impls:
            try:
                made = _function(impl, inputs)
                if isinstance(made, str):
                    notes[impl] = f"skipped: {made}"
                    continue
                fn, fn_args = made
                wrong = None if impl == "copy" else _check(fn, fn_args, expected)
            except Exception as error:  # noqa: BLE001 - one failing peer must not stop the rest
                notes[impl] = f"failed: {type(error).__name__}: {error!s:.160}"
                continue
            if wrong:
                notes[impl] = f"wrong result: {wrong}"
            else:
                fns[impl] = (fn, fn_args)
        power: dict[str, str] = {}
        # Each implementation takes its own arguments: all of them travel as one pytree.
        operands = {impl: fn_args for impl, (_, fn_args) in fns.items()}
        timed = bench_interleaved(
            {impl: (lambda ops, impl=impl, fn=fn: fn(*ops[impl])) for impl, (fn, _) in
             fns.items()}, [(operands,)], **timing, telemetry=power) if fns else {}
        kv_bytes = 2 * int(np.asarray(inputs[4]).sum()) * kv_heads * dim * inputs[1].itemsize
        flops = 4 * heads * q_len * dim * float(np.asarray(inputs[4]).sum())
        shape_rows = []
        for impl in args.impls:
            ms, note = timed.get(impl, math.nan), notes.get(impl, "")
            if isinstance(ms, Exception):
                ms, note = math.nan, f"failed: {type(ms).__name__}: {ms!s:.160}"
            elif not math.isnan(ms):
                moved = 2 * inputs[1].nbytes * 2 if impl == "copy" else kv_bytes
                note = f"{moved / ms / 1e6:.0f} GB/s" + (" read+written" if impl == "copy"
                                                        else " of K/V")
            shape_rows.append(dict(case=case, impl=impl, ms=ms,
                                   tflops=None if impl == "copy" else tflops(flops, ms),
                                   ratio=None, note="; ".join(filter(None, [note,
                                                                            power.get(impl)]))))
        ms_of = {row["impl"]: row["ms"] for row in shape_rows}
        baseline = next((ms_of[b] for b in BASELINES
                         if not math.isnan(ms_of.get(b, math.nan))), math.nan)
        for row in shape_rows:
            if row["impl"] != "copy" and not math.isnan(baseline) and not math.isnan(row["ms"]):
                row["ratio"] = baseline / row["ms"]
        # Each shape's rows as soon as they are timed: a sweep cut short by a time limit
        # keeps the shapes it finished.
        print(report.format_table(shape_rows), flush=True)
        rows += shape_rows
    return rows


if __name__ == "__main__":
    import sys

    from benchmarks.__main__ import main

    raise SystemExit(main(["paged", *sys.argv[1:]]))
