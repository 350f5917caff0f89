"""`omni_jax.flax.Attention` against a plain-JAX float64 layer with the same parameters."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import omni_jax
from omni_jax.flax import Attention, AxisNames, segment_positions
from omni_jax.flax.cache import as_pages
from omni_jax.paged.mosaic import PAGE_SIZES
from tests.omni_jax.flax.reference_layer import layer_params, reference_layer
from tests.reference import dense_mask, relative_error

BATCH, SEQ, FEATURES = 2, 24, 32
SEGMENTS = np.array([[1] * 10 + [2] * 14, [1] * 5 + [2] * 12 + [3] * 7], np.int32)
TOLERANCE = 2e-5  # float32 layer against the float64 reference


@dataclasses.dataclass(frozen=True)
class LayerCase:
    name: str
    layer: dict
    call: str  # which mask arguments the call gets

    def __str__(self):
        return self.name


CASES = [
    LayerCase("causal_documents_gqa_bias", dict(num_heads=4, num_kv_heads=2, use_bias=True),
              "causal_documents"),
    LayerCase("window_softcap_sinks_qknorm_mqa",
              dict(num_heads=4, num_kv_heads=1, qk_norm=True, learnable_sinks=True,
                   softcap=5.0), "window"),
    LayerCase("block_mask_no_rope", dict(num_heads=2, rope_base=None, head_dim=8),
              "block_mask"),
]


def _prefix_causal(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < 4 + 3 * b)


def make_layer(case: LayerCase, seed: int = 0) -> Attention:
    """A layer with every parameter random (biases and sinks too, not their zero init)."""
    layer = Attention(in_features=FEATURES, implementation="xla", rngs=nnx.Rngs(seed),
                      **case.layer)
    rng = np.random.default_rng(seed)
    for path, param in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        if path[-1] in ("bias", "sinks", "scale"):
            param[...] = jnp.asarray(rng.normal(1.0 if path[-1] == "scale" else 0.0, 0.5,
                                                param[...].shape), jnp.float32)
    return layer


def call_arguments(case: LayerCase) -> tuple[dict, dict]:
    """(layer kwargs, reference kwargs: positions and dense mask) for the case's masks."""
    heads = case.layer["num_heads"]
    if case.call == "causal_documents":
        kwargs = dict(is_causal=True, segment_ids=jnp.asarray(SEGMENTS))
        positions = np.asarray(segment_positions(jnp.asarray(SEGMENTS)))
        mask = dense_mask(BATCH, heads, SEQ, SEQ, is_causal=True, q_segment_ids=SEGMENTS,
                          kv_segment_ids=SEGMENTS)
    elif case.call == "window":
        kwargs = dict(local_window_size=(5, 2))
        positions = np.broadcast_to(np.arange(SEQ), (BATCH, SEQ))
        mask = dense_mask(BATCH, heads, SEQ, SEQ, window=(5, 2))
    else:
        positions = np.array([np.arange(SEQ) + 3, np.arange(SEQ)[::-1]])
        kwargs = dict(mask=omni_jax.create_block_mask(_prefix_causal, BATCH, None, SEQ, SEQ,
                                                      block_size=8),
                      positions=jnp.asarray(positions))
        mask = dense_mask(BATCH, heads, SEQ, SEQ, mask_fn=_prefix_causal)
    return kwargs, dict(positions=positions, mask=mask)


def test_segment_positions_restart_in_every_document():
    expected = np.concatenate([np.arange(5), np.arange(12), np.arange(7)])
    np.testing.assert_array_equal(segment_positions(jnp.asarray(SEGMENTS))[1], expected)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_layer_matches_reference(case, seed):
    layer = make_layer(case)
    x = jax.random.normal(jax.random.key(seed), (BATCH, SEQ, FEATURES))
    kwargs, reference_kwargs = call_arguments(case)
    out = layer(x, **kwargs)
    with jax.enable_x64(True):
        expected = reference_layer(layer_params(layer), np.asarray(x),
                                   rope_base=layer.rope_base, softcap=layer.softcap,
                                   **reference_kwargs)
    assert relative_error(out, expected) < TOLERANCE


def test_gradients_match_reference_under_nnx_jit(seed):
    case = CASES[1]
    layer = make_layer(case, seed=seed)
    x = jax.random.normal(jax.random.key(seed + 1), (BATCH, SEQ, FEATURES))
    weights = jax.random.normal(jax.random.key(seed + 2), (BATCH, SEQ, FEATURES))
    kwargs, reference_kwargs = call_arguments(case)

    @nnx.jit
    def grads(layer, x):
        return nnx.grad(lambda layer: jnp.sum(layer(x, **kwargs) * weights))(layer)

    actual = {"/".join(map(str, path)): value[...]
              for path, value in nnx.to_flat_state(grads(layer, x))}
    with jax.enable_x64(True):
        params = {k: jnp.asarray(v) for k, v in layer_params(layer).items()}
        loss = lambda p: jnp.sum(reference_layer(p, np.asarray(x), rope_base=layer.rope_base,
                                                 softcap=layer.softcap, **reference_kwargs)
                                 * np.asarray(weights, np.float64))
        expected = jax.grad(loss)(params)
    assert set(actual) == set(expected)
    for name, value in expected.items():
        assert relative_error(actual[name], value) < 1e-4, name


@pytest.mark.parametrize("masks", ["documents", "window_int", "window_list",
                                   "window_beyond_int32"])
def test_decode_with_cache_equals_full_sequence(masks, seed):
    layer = make_layer(CASES[1], seed=seed)
    x = jax.random.normal(jax.random.key(seed + 1), (BATCH, SEQ, FEATURES))
    if masks == "documents":
        full_kwargs = dict(is_causal=True, segment_ids=jnp.asarray(SEGMENTS))
        step_kwargs = lambda s: dict(segment_ids=jnp.asarray(SEGMENTS[:, s]))
        window = None
    else:
        # Static windows: closed over, not traced.
        window = {"window_int": 4, "window_list": [4, 0]}.get(masks, (2**40, 0))
        full_kwargs = dict(is_causal=True, local_window_size=(2**40 if masks ==
                                                              "window_beyond_int32" else 4, 0))
        step_kwargs = lambda s: {}
    full = layer(x, **full_kwargs)
    layer.init_cache(BATCH, SEQ + 8)
    step = nnx.jit(lambda layer, x, kwargs: layer(x, decode=True, local_window_size=window,
                                                  **kwargs))
    outs, start = [], 0
    for size in (7, 1, 1, 9, 6):  # a prompt, single tokens, chunks crossing documents
        part = slice(start, start + size)
        outs.append(step(layer, x[:, part], step_kwargs(part)))
        start += size
    np.testing.assert_array_equal(layer.cache_index[...], [SEQ, SEQ])
    assert relative_error(jnp.concatenate(outs, axis=1), full) < TOLERANCE


def three_tokens_in_a_cache_of_four(seed):
    """(layer, x [batch, 7, features], the full causal output of x) after decoding x[:, :3]."""
    layer = make_layer(CASES[0], seed=seed)
    x = jax.random.normal(jax.random.key(seed + 1), (BATCH, 7, FEATURES))
    full = layer(x, is_causal=True)
    layer.init_cache(BATCH, 4)
    assert relative_error(layer(x[:, :3], decode=True), full[:, :3]) < TOLERANCE
    return layer, x, full


def test_decode_past_the_cache_end_raises_eagerly(seed):
    layer, x, _ = three_tokens_in_a_cache_of_four(seed)
    cached_key = np.asarray(layer.cached_key[...])
    with pytest.raises(ValueError, match=r"max_len=4.*index 3 \+ 3 new tokens"):
        layer(x[:, 3:6], decode=True)
    with pytest.raises(ValueError, match=r"decode: the step has no tokens"):
        layer(x[:, 3:3], decode=True)
    np.testing.assert_array_equal(layer.cache_index[...], [3, 3])
    np.testing.assert_array_equal(layer.cached_key[...], cached_key)


def test_decode_past_the_cache_end_under_jit_gives_nan(seed):
    """A traced cache index cannot raise: the positions past the end come out NaN, the
    cached tokens stay intact and every later step is NaN too."""
    layer, x, full = three_tokens_in_a_cache_of_four(seed)
    cached_key = np.asarray(layer.cached_key[...])
    step = nnx.jit(lambda layer, x: layer(x, decode=True))
    out = step(layer, x[:, 3:6])
    assert relative_error(out[:, :1], full[:, 3:4]) < TOLERANCE  # slot 3 still fits
    assert np.isnan(np.asarray(out[:, 1:])).all()
    np.testing.assert_array_equal(layer.cached_key[...][:, :3], cached_key[:, :3])
    np.testing.assert_array_equal(layer.cache_index[...], [6, 6])
    assert np.isnan(np.asarray(step(layer, x[:, 6:7]))).all()
    with pytest.raises(ValueError, match="max_len=4"):
        layer(x[:, 6:7], decode=True)


@pytest.mark.parametrize("max_len,page", [(4096, 256), (48, 16), (20, 20)])
def test_cache_as_pages_views_each_sequence_in_order(max_len, page):
    """The contiguous cache as paged attention reads it: pages of the largest size the
    Mosaic kernel tiles that divides max_len (else one a sequence), in order."""
    keys = jnp.arange(2 * max_len * 3, dtype=jnp.float32).reshape(2, max_len, 3, 1)
    k_pages, v_pages, table = as_pages(keys, -keys)
    assert k_pages.shape == (2 * max_len // page, page, 3, 1)
    np.testing.assert_array_equal(k_pages[table].reshape(keys.shape), keys)
    np.testing.assert_array_equal(v_pages[table].reshape(keys.shape), -keys)
    mosaic_pages = as_pages(keys, keys, mosaic_only=True)
    assert (mosaic_pages is None) == (page not in PAGE_SIZES)


@pytest.mark.parametrize("documents", [False, True])
def test_decode_step_is_a_paged_call_unless_documents(documents, monkeypatch, seed):
    """Under jit a step on the contiguous cache calls paged attention (walks in closed
    form: no sort); packed documents keep the cache's BlockMask, built every step."""
    paged_calls = []
    paged = omni_jax.paged_attention
    monkeypatch.setattr(omni_jax, "paged_attention",
                        lambda *args, **kwargs: paged_calls.append(1) or paged(*args, **kwargs))
    layer = make_layer(CASES[1], seed=seed)
    layer.init_cache(BATCH, 64)
    graphdef, state = nnx.split(layer)
    kwargs = {"segment_ids": jnp.ones((BATCH, 1), jnp.int32)} if documents else {}

    def step(state, x):
        return nnx.merge(graphdef, state)(x, decode=True, local_window_size=(8, 0), **kwargs)

    text = jax.jit(step).lower(state, jnp.ones((BATCH, 1, FEATURES))).as_text()
    assert bool(paged_calls) != documents
    assert ("stablehlo.sort" in text) == documents


def test_nnx_scan_over_stacked_layers(seed):
    num_layers = 3

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return Attention(4, FEATURES, num_kv_heads=2, implementation="xla", rngs=rngs)

    layers = create(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(seed), (BATCH, SEQ, FEATURES))
    segments = jnp.asarray(SEGMENTS)

    @nnx.jit
    def forward(layers, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, layer):
            return x + layer(x, is_causal=True, segment_ids=segments)

        return body(x, layers)

    out = forward(layers, x)
    graphdef, state = nnx.split(layers)
    expected = x
    for i in range(num_layers):
        layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
        expected = expected + layer(expected, is_causal=True, segment_ids=segments)
    assert relative_error(out, expected) < TOLERANCE


def test_sharding_annotations():
    with nnx.use_eager_sharding(False):
        layer = Attention(4, FEATURES, use_bias=True, qk_norm=True, learnable_sinks=True,
                          axis_names=AxisNames(embed="data"), rngs=nnx.Rngs(0))
    specs = nnx.get_partition_spec(nnx.state(layer, nnx.Param))
    assert specs["query"]["kernel"].get_value() == jax.sharding.PartitionSpec("data", "model", None)
    assert specs["out"]["kernel"].get_value() == jax.sharding.PartitionSpec("model", None, "data")
    assert specs["sinks"].get_value() == jax.sharding.PartitionSpec("model")


def test_heads_sharded_over_two_devices_match_unsharded(seed):
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (conftest forces 2 CPU devices)")
    mesh = jax.make_mesh((2,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.random.normal(jax.random.key(seed), (BATCH, SEQ, FEATURES))
    plain = Attention(4, FEATURES, num_kv_heads=2, implementation="xla", rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh):
        sharded = Attention(4, FEATURES, num_kv_heads=2, implementation="xla",
                            axis_names=AxisNames(), rngs=nnx.Rngs(0))
        assert tuple(sharded.query.kernel[...].sharding.spec)[:2] == (None, "model")
        out = nnx.jit(lambda layer, x: layer(x, is_causal=True))(sharded, x)
    assert relative_error(out, plain(x, is_causal=True)) < TOLERANCE


@pytest.mark.parametrize("axis_names", [AxisNames(), AxisNames(embed="model", heads=None)],
                         ids=["heads", "embed"])
def test_explicitly_sharded_layer_matches_unsharded(axis_names, seed):
    """Explicit mesh axes (sharding in types): heads sharded, or the embedding that the
    projections contract over."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (conftest forces 2 CPU devices)")
    mesh = jax.make_mesh((2,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.random.normal(jax.random.key(seed), (BATCH, SEQ, FEATURES))
    kwargs = dict(num_kv_heads=2, implementation="xla", learnable_sinks=True)
    plain = Attention(4, FEATURES, **kwargs, rngs=nnx.Rngs(0))
    loss = lambda layer, x: (layer(x, is_causal=True) ** 2).sum()
    with jax.set_mesh(mesh):
        sharded = Attention(4, FEATURES, **kwargs, axis_names=axis_names, rngs=nnx.Rngs(0))
        out = nnx.jit(lambda layer, x: layer(x, is_causal=True))(sharded, x)
        grads = nnx.jit(nnx.grad(loss))(sharded, x)
    assert relative_error(out, plain(x, is_causal=True)) < TOLERANCE
    want = nnx.grad(loss)(plain, x)
    assert relative_error(grads["query"]["kernel"][...], want["query"]["kernel"][...]) < TOLERANCE
    assert relative_error(grads["sinks"][...], want["sinks"][...]) < TOLERANCE


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        Attention(4, FEATURES, num_kv_heads=3, rngs=nnx.Rngs(0))
    layer = Attention(2, FEATURES, implementation="xla", rngs=nnx.Rngs(0))
    x = jnp.ones((1, 4, FEATURES))
    with pytest.raises(ValueError, match="init_cache"):
        layer(x, decode=True)
    layer.init_cache(1, 8)
    with pytest.raises(ValueError, match="mask and score_mod"):
        layer(x, decode=True, score_mod=lambda s, b, h, q, k: s)
    with pytest.raises(ValueError, match="batch"):
        layer(jnp.ones((2, 1, FEATURES)), decode=True)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: Attention(4, 12, rngs=nnx.Rngs(0)),
     r"head_dim must be even, got 3; choose an even head_dim or pass rope_base=None"),
    (lambda: Attention(2, FEATURES, implementation="Triton", rngs=nnx.Rngs(0)),
     r"implementation must be one of .* got 'Triton'"),
    (lambda: Attention(2, FEATURES, rngs=nnx.Rngs(0))(jnp.ones((1, 4, 16))),
     r"x must be \[batch, seq, in_features\] with in_features=32, got shape \(1, 4, 16\)"),
    (lambda: Attention(2, FEATURES, rngs=nnx.Rngs(0))(jnp.ones((4, FEATURES))),
     r"x must be \[batch, seq, in_features\] .* got shape \(4, 32\)"),
])
def test_bad_layer_arguments_are_named(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_gradients_reach_the_attention_call(deterministic, monkeypatch):
    """The layers' ``deterministic_gradients`` is `omni_jax.attention`'s ``deterministic``
    (Flax's own ``deterministic`` is about dropout)."""
    from flax import linen as nn

    from omni_jax.flax import linen as omni_linen
    from omni_jax.flax import make_attention_fn

    seen = []
    attention = omni_jax.attention
    monkeypatch.setattr(omni_jax, "attention", lambda *args, **kwargs: seen.append(
        kwargs["deterministic"]) or attention(*args, **kwargs))
    x = jnp.ones((1, 8, 16), jnp.float32)
    Attention(2, 16, deterministic_gradients=deterministic, rngs=nnx.Rngs(0))(x)
    layer = omni_linen.Attention(2, 16, deterministic_gradients=deterministic)
    layer.apply(layer.init(jax.random.key(0), x), x)
    module = nn.MultiHeadDotProductAttention(
        2, attention_fn=make_attention_fn(deterministic_gradients=deterministic))
    module.apply(module.init(jax.random.key(0), x), x)
    assert len(seen) == 5 and set(seen) == {deterministic}  # init and apply for linen
    with pytest.raises(TypeError, match="deterministic_gradients"):
        Attention(2, 16, deterministic_gradients=None, rngs=nnx.Rngs(0))
