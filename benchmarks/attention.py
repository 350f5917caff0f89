"""The attention benchmark: every omni_jax backend beside its peers, in one table.

Implementations (``--impls``): ``omni_xla``, ``omni_triton``, ``omni_mosaic``
(our backends, where available; ``omni_mosaic/FIELD=N/...`` forces fields of the Mosaic
forward's `ForwardConfig`, e.g. ``omni_mosaic/pipelined=0/q_blocks_per_cta=2`` or
``omni_mosaic/num_consumers=2`` (dense head dim 64 with two consumers, as before 192-row
CTAs), and
``bwd.FIELD=N`` those of its backward's `BackwardConfig`, e.g.
``omni_mosaic/bwd.dkv_stages=2``, for A/B runs of its configs; ``deterministic=0``
passes ``deterministic=False``), ``cudnn`` and ``jax_xla``
(`jax.nn.dot_product_attention`), ``jax_pallas_mha`` (JAX's Pallas Triton
``mha``), ``jax_mgpu`` (JAX's Mosaic ``attention_mgpu``: float16 only, so it
runs on float16 copies of the inputs), ``fa3`` (FlashAttention-3 for JAX,
``flash_attn3_jax``: ``flash_mha``, ``flash_mha_varlen`` for documents), ``fa4``
(FlashAttention-4 for JAX, ``fa4_jax.flash_attn``, documents as its
``document_mask`` mask_mod) and ``tokamax`` (the peers where importable). An
implementation that cannot run a case gets a row with its reason in the note.
Before timing, every implementation's output (the gradients for fwd+bwd) is
checked against omni_jax's XLA backend in float32 (`--no-check` skips it); one
that is off by more than `TOLERANCE` or returns NaN gets a "wrong" row, untimed.
The implementations of a case are timed together, their samples interleaved
(`benchmarks.timing.bench_interleaved`), so clock drift hits them alike.
``ratio`` is the baseline's time over the row's: ``--baseline`` names one
implementation or several (the fastest of them that ran, e.g. ``fa3,fa4``).

TFLOP/s count only unmasked work (4 * B * H * D * visible (q, k) pairs for the
forward, 2.5x that for the backward), so masked cases compare by useful work;
masked cases also report the fraction of active mask blocks and, when the
dense case of the same length was measured, time / (dense time x fraction):
1.0 means skipping is perfect.

    python -m benchmarks attention                      # all cases, the default impls
    python -m benchmarks attention --cases s4096 --impls omni_triton,cudnn
    python -m benchmarks attention --cases "d128 fwd" --dtype float16
    python -m benchmarks attention --seqs 1024 4096 32768 --forward-only   # walk lengths
    python -m benchmarks attention --tiny               # CPU smoke run
    python -m benchmarks attention --cases "d128,d64" --impls omni_mosaic,fa3,fa4,cudnn \
        --baseline fa3,fa4                              # beside the FlashAttention peers
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

import omni_jax
from benchmarks.timing import add_impls_argument, add_sustain_argument, bench_interleaved, tflops

BASELINE = "cudnn"
IMPLS = ("omni_xla", "omni_triton", "omni_mosaic", "cudnn", "jax_xla", "jax_pallas_mha",
         "jax_mgpu", "fa3", "fa4", "tokamax")
# Relative error (Frobenius norm) against the float32 reference that an output may have:
# 16-bit inputs and outputs give about 4e-3, their gradients about 1e-2.
TOLERANCE = 3e-2
# "omni_mosaic/FIELD=N/...": the Mosaic backend with those ForwardConfig fields (and
# BackwardConfig fields, as "bwd.FIELD=N") forced.
FORCED_MOSAIC_PREFIX = "omni_mosaic/"
BACKWARD_FIELD_PREFIX = "bwd."
# "omni_mosaic/deterministic=0": `omni_jax.attention(..., deterministic=False)`.
DETERMINISTIC_FIELD = "deterministic"
WINDOW = 1024
NUM_DOCUMENTS = 8
DOCUMENT_MASKS = ("documents", "causal_documents")


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    seq: int
    heads: int
    head_dim: int
    # "dense", "causal", "documents" (NUM_DOCUMENTS packed documents, each attending to
    # itself), "causal_documents" (the same, causal: a causal LM's packed rows), "window"
    # (causal, WINDOW keys back) or "alibi" (causal with ALiBi: a score_mod capturing
    # per-head slopes; cuDNN gets it as a bias).
    mask: str
    backward: bool
    dtype: str = "bfloat16"
    # The value head dim when it differs from the query-key one (DeepSeek's MLA in
    # training: query-key 192, value 128); named "d192v128".
    value_head_dim: int | None = None

    @property
    def name(self) -> str:
        direction = "fwd+bwd" if self.backward else "fwd"
        dtype = "" if self.dtype == "bfloat16" else f" {self.dtype}"
        value = "" if self.value_head_dim is None else f"v{self.value_head_dim}"
        return (f"{self.mask} b{self.batch} s{self.seq} h{self.heads} d{self.head_dim}{value} "
                f"{direction}{dtype}")

    @property
    def v_head_dim(self) -> int:
        return self.head_dim if self.value_head_dim is None else self.value_head_dim


def default_cases(tiny: bool) -> list[Case]:
    if tiny:
        return [Case(1, 128, 2, 32, mask, backward, "float32")
                for mask in ("dense", "causal", *DOCUMENT_MASKS, "window", "alibi")
                for backward in (False, True)]
    cases = []
    for seq in (4096, 16384):
        for mask in ("dense", "causal"):
            for backward in (False, True):
                cases.append(Case(16384 // seq, seq, 16, 128, mask, backward))
    # Causal at 32k is cuDNN's best answer to a document mask (it has no segment ids).
    for mask in ("dense", "causal", *DOCUMENT_MASKS, "window"):
        for backward in (False, True):
            cases.append(Case(1, 32768, 16, 128, mask, backward))
    # Forward and backward at every other head dim: at 192 and 256 the Mosaic backward
    # sums dK and dV in launches of their own.
    for head_dim in (64, 192, 256):
        for mask in ("dense", "causal"):
            for backward in (False, True):
                cases.append(Case(4, 4096, 16, head_dim, mask, backward))
    for mask in ("dense", "causal"):
        for backward in (False, True):
            cases.append(Case(4, 4096, 16, 192, mask, backward, value_head_dim=128))
    # Head dim 96 (Phi-3 and others): the Mosaic kernels serve it natively, not padded.
    for mask in ("dense", "causal"):
        for backward in (False, True):
            cases.append(Case(4, 4096, 16, 96, mask, backward))
    for backward in (False, True):
        cases.append(Case(4, 4096, 16, 128, "alibi", backward))
    return cases


# --------------------------------------------------------------------------- masks and flops


def _segment_ids(case: Case) -> np.ndarray:
    """[batch, seq] ids of NUM_DOCUMENTS documents of random lengths (fixed seed)."""
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, case.seq), NUM_DOCUMENTS - 1, replace=False))
    ids = np.searchsorted(cuts, np.arange(case.seq), side="right")
    return np.broadcast_to(ids, (case.batch, case.seq)).astype(np.int32)


def visible_pairs(case: Case) -> float:
    """Unmasked (query, key) pairs per batch row and head."""
    s = case.seq
    if case.mask == "dense":
        return float(s * s)
    if case.mask in ("causal", "alibi"):
        return s * (s + 1) / 2
    if case.mask == "window":
        return float(sum(min(i, WINDOW) + 1 for i in range(s)))
    lengths = np.bincount(_segment_ids(case)[0]).astype(np.float64)
    if case.mask == "causal_documents":
        return float((lengths * (lengths + 1) / 2).sum())
    return float((lengths ** 2).sum())


def case_flops(case: Case) -> float:
    head_dims = case.head_dim + case.v_head_dim
    forward = 2.0 * case.batch * case.heads * head_dims * visible_pairs(case)
    return forward * 3.5 if case.backward else forward


def _alibi_slopes(heads: int) -> jax.Array:
    return 2.0 ** (-8.0 * (jnp.arange(heads, dtype=jnp.float32) + 1) / heads)


def _omni_mask_kwargs(case: Case) -> dict[str, Any]:
    if case.mask == "causal":
        return {"is_causal": True}
    if case.mask == "alibi":
        slopes = _alibi_slopes(case.heads)
        return {"is_causal": True,
                "score_mod": lambda s, b, h, i, j: s - slopes[h] * (i - j).astype(s.dtype)}
    if case.mask == "window":
        return {"local_window_size": (WINDOW, 0)}
    if case.mask in DOCUMENT_MASKS:
        return {"q_segment_ids": jnp.asarray(_segment_ids(case)),
                "is_causal": case.mask == "causal_documents"}
    return {}


def case_mask_mod(case: Case) -> Any:
    """The structured mask that the case's `omni_jax.attention` arguments build (None:
    dense), for counting its tiles and elements."""
    kwargs = _omni_mask_kwargs(case)
    parts = []
    if kwargs.get("is_causal"):
        parts.append(omni_jax.causal_mask)
    if "local_window_size" in kwargs:
        parts.append(omni_jax.sliding_window_mask(*kwargs["local_window_size"]))
    if "q_segment_ids" in kwargs:
        parts.append(omni_jax.document_mask(kwargs["q_segment_ids"]))
    return omni_jax.and_masks(*parts) if parts else None


def active_block_fraction(case: Case, block: int = 128) -> float:
    """Fraction of (q-block, kv-block) tiles the block-sparse kernels visit."""
    mask_mod = case_mask_mod(case)
    if mask_mod is None:
        return 1.0
    block_mask = omni_jax.create_block_mask(mask_mod, case.batch, None, case.seq, case.seq,
                                            block)
    tiles = block_mask.kv_indices.shape[-2] * block_mask.kv_indices.shape[-1]
    return float(np.asarray(block_mask.kv_num_blocks).sum()) / (
        tiles * np.prod(block_mask.kv_num_blocks.shape[:2]))


# --------------------------------------------------------------------------- implementations


class Unsupported(Exception):
    """An implementation cannot run a case; the message goes into the row's note."""


def _omni(backend: str, deterministic: bool = True) -> Callable[[Case], Callable]:
    def build(case: Case):
        from omni_jax.backends import get_backend

        reason = get_backend(backend).unavailable_reason()
        if reason:
            raise Unsupported(reason)
        kwargs = _omni_mask_kwargs(case)
        return lambda q, k, v: omni_jax.attention(q, k, v, implementation=backend,
                                                  deterministic=deterministic, **kwargs)

    return build


def _forced_mosaic(fields: dict[str, int], backward_fields: dict[str, int],
                   deterministic: bool = True) -> Callable[[Case], Callable]:
    """``omni_mosaic`` with fields of the forward kernel's `ForwardConfig` and the backward
    kernels' `BackwardConfig` forced (the configs are read while tracing), for an A/B of
    configs inside one run."""
    def build(case: Case):
        from pallas_kernels.mosaic import attention_bwd_sm90 as bwd
        from pallas_kernels.mosaic import attention_fwd_sm90 as fwd

        attention = _omni("mosaic", deterministic)(case)

        def forcing(module, name, forced_fields):
            default = getattr(module, name)

            def forced(*args, **kwargs):
                config = default(*args, **kwargs)
                if config is None:
                    return None
                return dataclasses.replace(config, **{
                    field: type(getattr(config, field))(value)
                    for field, value in forced_fields.items()})

            return mock.patch.object(module, name, forced)

        @contextlib.contextmanager
        def forced_configs():
            with forcing(fwd, "forward_config", fields), \
                    forcing(bwd, "backward_config", backward_fields):
                yield

        def run(q, k, v):
            with forced_configs():
                return attention(q, k, v)

        # The backward is traced after `run` returns: `_timed_fn` keeps the configs
        # forced while it traces the whole timed function.
        run.tracing_context = forced_configs
        return run

    return build


def builder(impl: str) -> Callable[[Case], Callable]:
    """The builder of an ``--impls`` name (`IMPLS`, or ``omni_mosaic/FIELD=N/...``)."""
    if impl in BUILDERS:
        return BUILDERS[impl]
    if impl.startswith(FORCED_MOSAIC_PREFIX):
        from pallas_kernels.mosaic import attention_bwd_sm90 as bwd
        from pallas_kernels.mosaic import attention_fwd_sm90 as fwd

        names = {field.name for field in dataclasses.fields(fwd.ForwardConfig)}
        backward_names = {BACKWARD_FIELD_PREFIX + field.name
                          for field in dataclasses.fields(bwd.BackwardConfig)}
        names |= {DETERMINISTIC_FIELD}
        fields, backward_fields = {}, {}
        for item in impl[len(FORCED_MOSAIC_PREFIX):].split("/"):
            name, _, value = item.partition("=")
            if name not in names | backward_names or not value.lstrip("-").isdigit():
                raise ValueError(f"{impl!r}: expected FIELD=N with FIELD one of "
                                 f"{sorted(names | backward_names)}, got {item!r}")
            if name in backward_names:
                backward_fields[name[len(BACKWARD_FIELD_PREFIX):]] = int(value)
            else:
                fields[name] = int(value)
        deterministic = bool(fields.pop(DETERMINISTIC_FIELD, 1))
        return _forced_mosaic(fields, backward_fields, deterministic)
    raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS} or "
                     f"{FORCED_MOSAIC_PREFIX}FIELD=N/...")


def _jax_nn(implementation: str) -> Callable[[Case], Callable]:
    def build(case: Case):
        if implementation == "cudnn" and jax.default_backend() != "gpu":
            raise Unsupported("cuDNN needs a GPU")
        if case.value_head_dim not in (None, case.head_dim):
            raise Unsupported("jax.nn.dot_product_attention takes no value head dim of its own")
        if case.mask in DOCUMENT_MASKS:
            if implementation != "cudnn":
                raise Unsupported("jax.nn.dot_product_attention has no segment ids")
            return _documents_as_padded_batch(case)
        kwargs = {"is_causal": case.mask in ("causal", "window", "alibi")}
        if case.mask == "window":
            kwargs["local_window_size"] = (WINDOW, 0)
        if case.mask == "alibi":
            # The ALiBi bias materialized once, outside the timed function ([1, H, S, S]).
            distance = jnp.arange(case.seq)[:, None] - jnp.arange(case.seq)[None, :]
            kwargs["bias"] = (-_alibi_slopes(case.heads)[:, None, None]
                              * distance).astype(case.dtype)[None]
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=implementation,
                                                            **kwargs)

    return build


def _documents_as_padded_batch(case: Case) -> Callable:
    """cuDNN given the documents: one padded sequence per document, with its length.

    jax.nn.dot_product_attention has no segment ids; its closest form is a batch of
    documents padded to the longest, masked by sequence lengths. The timed function
    includes the gather into that batch and the scatter back.
    """
    ids = _segment_ids(case)[0]
    lengths = np.bincount(ids, minlength=NUM_DOCUMENTS)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    longest = int(lengths.max())
    gather = np.minimum(starts[:, None] + np.arange(longest)[None, :], case.seq - 1)
    offsets = np.arange(case.seq) - starts[ids]
    seq_lengths = jnp.asarray(np.tile(lengths, case.batch), jnp.int32)

    def attention(q, k, v):
        def pack(x):
            return x[:, gather].reshape(-1, longest, *x.shape[2:])

        out = jax.nn.dot_product_attention(
            pack(q), pack(k), pack(v), query_seq_lengths=seq_lengths,
            key_value_seq_lengths=seq_lengths, is_causal=case.mask == "causal_documents",
            implementation="cudnn")
        return out.reshape(case.batch, len(lengths), longest, *out.shape[2:])[:, ids, offsets]

    return attention


def _pallas_mha(case: Case):
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    if case.mask == "window":
        raise Unsupported("mha has no sliding window")
    if case.mask == "alibi":
        raise Unsupported("mha has no score_mod")
    interpret = jax.default_backend() != "gpu"
    segment_ids = jnp.asarray(_segment_ids(case)) if case.mask in DOCUMENT_MASKS else None
    scale = case.head_dim ** -0.5
    return lambda q, k, v: pallas_attention.mha(q, k, v, segment_ids, sm_scale=scale,
                                                causal=case.mask in ("causal",
                                                                     "causal_documents"),
                                                interpret=interpret)


def _mgpu(case: Case):
    if jax.default_backend() != "gpu":
        raise Unsupported("Mosaic GPU needs a Hopper GPU")
    if case.mask not in ("dense", "causal"):
        raise Unsupported("attention_mgpu supports dense and causal only")
    if case.backward and case.mask == "causal":
        raise Unsupported("attention_mgpu has no causal backward")
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    # The forward tiles of JAX's own benchmark at head dim 128; the backward ones (its
    # dense-only backward needs them) from its tests, two compute warpgroups up to 128.
    config = attention_mgpu.TuningConfig(
        block_q=64, block_kv=128, max_concurrent_steps=2, causal=case.mask == "causal",
        compute_wgs_bwd=2 if case.head_dim <= 128 else 1,
        block_q_dq=64, block_kv_dq=128, block_q_dkv=128, block_kv_dkv=64)
    return lambda q, k, v: attention_mgpu.attention(q.astype(jnp.float16),
                                                    k.astype(jnp.float16),
                                                    v.astype(jnp.float16), config)


def _cumulative_lengths(case: Case) -> jax.Array:
    """[batch * NUM_DOCUMENTS + 1] starts of the documents in the flattened token axis."""
    lengths = np.bincount(_segment_ids(case)[0], minlength=NUM_DOCUMENTS)
    starts = np.cumsum(np.tile(lengths, case.batch))
    return jnp.asarray(np.concatenate([[0], starts]), jnp.int32)


def _fa3(case: Case):
    """FlashAttention-3 for JAX (head dims up to 128; documents through its varlen call)."""
    try:
        import flash_attn3_jax
    except ImportError as error:
        raise Unsupported("flash_attn3_jax is not installed") from error
    if jax.default_backend() != "gpu":
        raise Unsupported("flash_attn3_jax needs a GPU")
    if max(case.head_dim, case.v_head_dim) > 128:
        raise Unsupported("flash_attn3_jax takes head dims up to 128")
    if case.mask == "alibi":
        raise Unsupported("flash_attn3_jax has no score_mod or bias")
    causal = case.mask in ("causal", "window", "causal_documents")
    window = (WINDOW, 0) if case.mask == "window" else (-1, -1)
    if case.mask in DOCUMENT_MASKS:
        starts = _cumulative_lengths(case)
        longest = int(np.bincount(_segment_ids(case)[0]).max())

        def varlen(q, k, v):
            flat = lambda x: x.reshape(-1, *x.shape[2:])
            out = flash_attn3_jax.flash_mha_varlen(
                flat(q), flat(k), flat(v), starts, starts, max_seqlen_q=longest,
                max_seqlen_k=longest, is_causal=causal)
            return out.reshape(q.shape[:3] + out.shape[-1:])

        return varlen
    return lambda q, k, v: flash_attn3_jax.flash_mha(q, k, v, is_causal=causal,
                                                     window_size=window)


def _fa4(case: Case):
    """FlashAttention-4 for JAX (its CuTe DSL kernels; documents as a mask_mod)."""
    try:
        import fa4_jax
    except ImportError as error:
        raise Unsupported("fa4_jax is not installed") from error
    if jax.default_backend() != "gpu":
        raise Unsupported("fa4_jax's kernels need a GPU")
    if case.mask == "alibi":
        raise Unsupported("fa4_jax has no score_mod")
    kwargs: dict[str, Any] = {"causal": case.mask in ("causal", "window", "causal_documents")}
    if case.mask == "window":
        kwargs["window_size"] = (WINDOW, 0)
    if case.mask in DOCUMENT_MASKS:
        kwargs["mask_mod"] = fa4_jax.document_mask(jnp.asarray(_segment_ids(case)))
    return lambda q, k, v: fa4_jax.flash_attn(q, k, v, **kwargs)


def _tokamax(case: Case):
    try:
        import tokamax
    except ImportError as error:
        raise Unsupported("tokamax is not installed") from error
    if case.mask in (*DOCUMENT_MASKS, "alibi"):
        raise Unsupported(f"{case.mask} not wired for tokamax")
    kwargs = {"is_causal": case.mask in ("causal", "window")}
    if case.mask == "window":
        kwargs["local_window_size"] = (WINDOW, 0)
    return lambda q, k, v: tokamax.dot_product_attention(q, k, v, **kwargs)


BUILDERS: dict[str, Callable[[Case], Callable]] = {
    "omni_xla": _omni("xla"), "omni_triton": _omni("triton"), "omni_mosaic": _omni("mosaic"),
    "cudnn": _jax_nn("cudnn"), "jax_xla": _jax_nn("xla"), "jax_pallas_mha": _pallas_mha,
    "jax_mgpu": _mgpu, "fa3": _fa3, "fa4": _fa4, "tokamax": _tokamax,
}


def _timed_fn(attention: Callable, backward: bool) -> Callable:
    """The jitted timed function; traced inside ``attention.tracing_context()`` if the
    builder set one (forced configs)."""
    context = getattr(attention, "tracing_context", contextlib.nullcontext)

    def forward(q, k, v):
        with context():
            return attention(q, k, v)

    def forward_backward(q, k, v, dout):
        with context():
            out, vjp = jax.vjp(attention, q, k, v)
            return vjp(dout.astype(out.dtype))

    return jax.jit(forward_backward if backward else forward)


def _inputs(case: Case, copies: int) -> list[tuple]:
    shape = (case.batch, case.seq, case.heads, case.head_dim)
    value_shape = (*shape[:3], case.v_head_dim)
    sets = []
    for i in range(copies):
        keys = jax.random.split(jax.random.key(i), 4)
        arrays = [jax.random.normal(key, value_shape if j >= 2 else shape, case.dtype)
                  for j, key in enumerate(keys)]
        sets.append(tuple(arrays) if case.backward else tuple(arrays[:3]))
    return sets


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_impls_argument(parser, default=IMPLS, check=builder,
                       choices=f"{', '.join(IMPLS)}, or {FORCED_MOSAIC_PREFIX}FIELD=N/... "
                               f"(a Mosaic config)")
    parser.add_argument("--cases", default="",
                        help="comma-separated substrings; keep cases whose name contains one "
                             "(e.g. 's4096', 'causal', 'fwd+bwd', 'd64')")
    parser.add_argument("--seqs", type=int, nargs="+", default=[],
                        help="instead of the default cases: dense and causal at these "
                             "sequence lengths, 16k tokens each (see `length_sweep`)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128],
                        help="the head dims of the --seqs cases (default 128)")
    parser.add_argument("--forward-only", action="store_true",
                        help="leave out the forward+backward cases")
    parser.add_argument("--tiny", action="store_true", help="tiny float32 shapes (CPU smoke run)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default=None,
                        help="input dtype of the cases (default: bfloat16, float32 with --tiny)")
    parser.add_argument("--baseline", default=BASELINE,
                        help="the implementation(s) the ratio compares with: one name, or "
                             "several comma-separated (the fastest of them that ran, e.g. "
                             f"'fa3,fa4'); default {BASELINE}")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="time the implementations without first checking their output "
                             "against the float32 XLA reference")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--inner", type=int, default=3)
    add_sustain_argument(parser)


def length_sweep(seqs: list[int], head_dims: tuple[int, ...] = (128,)) -> list[Case]:
    """Dense and causal cases at each length and head dim, 16k tokens (batch x seq; one
    sequence when longer), forward and forward+backward: how the walk length matters."""
    return [Case(max(1, 16384 // seq), seq, 16, head_dim, mask, backward)
            for head_dim in head_dims for seq in seqs for mask in ("dense", "causal")
            for backward in (False, True)]


def _selected_cases(args) -> list[Case]:
    cases = (length_sweep(args.seqs, tuple(args.head_dims)) if args.seqs
             else default_cases(args.tiny))
    if args.forward_only:
        cases = [c for c in cases if not c.backward]
    if args.dtype:
        cases = [dataclasses.replace(c, dtype=args.dtype) for c in cases]
    wanted = [w for w in args.cases.split(",") if w]
    return [c for c in cases if not wanted or any(w in c.name for w in wanted)]


def _relative_error(got: Any, want: Any) -> float:
    """The largest relative (Frobenius) error over matching leaves; NaN if any is NaN."""
    errors = []
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            raise ValueError(f"output shape {a.shape}, the reference's {b.shape}")
        if not np.isfinite(a).all():
            return float("nan")
        errors.append(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    return max(errors)


def _wrong_output(fn: Callable, reference: Any, arguments: tuple) -> str | None:
    """Why ``fn`` is not timed (its output differs from ``reference``), or None."""
    error = _relative_error(fn(*arguments), reference)
    if error <= TOLERANCE:
        return None
    return f"wrong: relative error {error:.2e} against the float32 reference (NaN: non-finite)"


def _reference(case: Case, arguments: tuple) -> Any:
    """The float32 XLA backend's output (or gradients) on ``arguments``."""
    fn = _timed_fn(_omni("xla")(case), case.backward)
    return fn(*(x.astype(jnp.float32) for x in arguments))


def _baseline_ms(case_rows: list[dict], baseline: str) -> float | None:
    """The time ``ratio`` divides: the fastest finite one of the named implementations."""
    names = baseline.split(",")
    times = [r["ms"] for r in case_rows if r["impl"] in names and np.isfinite(r["ms"])]
    return min(times) if times else None


def _skip_note(case: Case, dense_ms: dict, impl: str, ms: float) -> str:
    if case.mask == "dense":
        return ""
    fraction = active_block_fraction(case)
    note = f"active blocks {fraction:.1%}; TFLOP/s count unmasked work only"
    dense = dense_ms.get((dataclasses.replace(case, mask="dense"), impl))
    if dense is not None:
        note += f"; time/(dense x fraction) = {ms / (dense * fraction):.2f}"
    if case.mask in DOCUMENT_MASKS:
        if impl == BASELINE:
            note += "; cuDNN: the documents as a padded batch with sequence lengths"
        causal = dense_ms.get((dataclasses.replace(case, mask="causal"), BASELINE))
        if causal is not None:
            note += f"; {causal / ms:.2f}x faster than cuDNN causal"
    return note


def run(args) -> list[dict]:
    impls = list(args.impls)
    builders = {impl: builder(impl) for impl in impls}
    print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
          f"device {jax.devices()[0].device_kind} ({jax.default_backend()})")
    rows, dense_ms = [], {}
    for case in _selected_cases(args):
        flops = case_flops(case)
        notes, fns = {}, {}
        for impl in impls:
            try:
                fns[impl] = _timed_fn(builders[impl](case), case.backward)
            except Exception as error:  # noqa: BLE001 - a peer failing must not stop the table
                notes[impl] = _failure_note(error)
        inputs = _inputs(case, 2)
        if args.check and fns:
            reference = _reference(case, inputs[0])
            for impl, fn in list(fns.items()):
                try:
                    wrong = _wrong_output(fn, reference, inputs[0])
                except Exception as error:  # noqa: BLE001 - reported in its row
                    wrong = _failure_note(error)
                if wrong:
                    notes[impl] = wrong
                    del fns[impl]
            del reference
        # Timed together, samples alternating: clock drift hits every implementation alike.
        power: dict[str, str] = {}
        timed = bench_interleaved(fns, inputs, warmup=args.warmup,
                                  samples=args.samples, inner=args.inner,
                                  sustain_s=args.sustain, telemetry=power)
        case_rows = []
        for impl in impls:
            ms = timed.get(impl)
            if isinstance(ms, Exception):
                notes[impl] = _failure_note(ms)
            if impl in notes:
                case_rows.append(_row(case, impl, float("nan"), 0.0, notes[impl]))
                continue
            dense_ms[(case, impl)] = ms
            note = _skip_note(case, dense_ms, impl, ms)
            if impl == "jax_mgpu":
                note = "; ".join(filter(None, ["float16 inputs (bf16 unsupported)", note]))
            note = "; ".join(filter(None, [note, power.get(impl)]))
            case_rows.append(_row(case, impl, ms, tflops(flops, ms), note))
        baseline = _baseline_ms(case_rows, args.baseline)
        for row in case_rows:
            if baseline is not None and np.isfinite(row["ms"]):
                row["ratio"] = baseline / row["ms"]
        rows.extend(case_rows)
    return rows


def _failure_note(error: Exception) -> str:
    """The note of an implementation without a time: skipped (`Unsupported`) or failed."""
    if isinstance(error, Unsupported):
        return f"skipped: {error}"
    message = str(error).strip().splitlines()[0][:160] if str(error) else ""
    return f"failed: {type(error).__name__}: {message}"


def _row(case: Case, impl: str, ms: float, throughput: float, note: str) -> dict:
    return {"case": case.name, "impl": impl, "ms": ms, "tflops": throughput, "ratio": None,
            "note": note}


if __name__ == "__main__":
    import sys

    from benchmarks.__main__ import main

    raise SystemExit(main(["attention", *sys.argv[1:]]))
