"""The attention benchmark runs end to end on tiny CPU shapes (keeps the CLI from rotting)."""

import argparse
import math

import jax
import jax.numpy as jnp
import pytest

from benchmarks import attention
from pallas_kernels import runtime
from pallas_kernels.mosaic import attention_bwd_sm90 as bwd
from pallas_kernels.mosaic import attention_fwd_sm90 as fwd
from tests.forced_configs import record_configs


def test_tiny_run_produces_rows_for_every_impl(monkeypatch, capsys):
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    parser = argparse.ArgumentParser()
    attention.add_arguments(parser)
    impls = ["omni_xla", "omni_triton", "cudnn", "jax_pallas_mha"]
    args = parser.parse_args(["--tiny", "--cases",
                              "dense,window b1 s128 h2 d32 fwd+bwd,alibi b1 s128 h2 d32 fwd",
                              "--impls", ",".join(impls), "--warmup", "1", "--samples", "1",
                              "--inner", "1"])
    rows = attention.run(args)
    assert "jax " in capsys.readouterr().out
    cases = {row["case"] for row in rows}
    assert len(cases) == 5
    assert len(rows) == len(cases) * len(impls)
    for row in rows:
        assert set(row) == {"case", "impl", "ms", "tflops", "ratio", "note"}
        if row["impl"] in ("omni_xla", "omni_triton"):
            assert math.isfinite(row["ms"]) and row["ms"] > 0, row
        if row["impl"] == "cudnn" and jax.default_backend() != "gpu":
            assert row["note"].startswith("skipped"), row
    window = [r for r in rows if r["case"].startswith("window") and r["impl"] == "omni_xla"]
    assert "active blocks" in window[0]["note"]


def test_dtype_option_sets_every_case(monkeypatch):
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    parser = argparse.ArgumentParser()
    attention.add_arguments(parser)
    args = parser.parse_args(["--tiny", "--dtype", "float16", "--cases", "dense", "--impls",
                              "omni_xla", "--warmup", "1", "--samples", "1", "--inner", "1"])
    assert {c.dtype for c in attention._selected_cases(args)} == {"float16"}
    rows = attention.run(args)
    assert [row["case"] for row in rows] == ["dense b1 s128 h2 d32 fwd float16",
                                             "dense b1 s128 h2 d32 fwd+bwd float16"]
    assert all(math.isfinite(row["ms"]) for row in rows)


def test_cli_help():
    parser = argparse.ArgumentParser()
    attention.add_arguments(parser)
    assert "--tiny" in parser.format_help()


@pytest.mark.parametrize("mask", attention.DOCUMENT_MASKS)
def test_cudnn_documents_form_is_the_document_mask(mask, monkeypatch):
    """cuDNN's row for documents (a padded batch with lengths) computes the same attention."""
    import jax.numpy as jnp
    import numpy as np

    import omni_jax

    plain = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, implementation=None, **k: plain(*a, implementation="xla", **k))
    case = attention.Case(2, 256, 2, 32, mask, False, "float32")
    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.standard_normal((2, 256, 2, 32)), jnp.float32) for _ in range(3))
    out = attention._documents_as_padded_batch(case)(q, k, v)
    expected = omni_jax.attention(q, k, v, implementation="xla",
                                  **attention._omni_mask_kwargs(case))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask", ["dense", "causal", *attention.DOCUMENT_MASKS, "window", "alibi"])
def test_visible_pairs_count_the_masks_elements(mask):
    """The TFLOP/s count (unmasked work only) agrees with the mask the case builds."""
    import numpy as np

    import omni_jax

    case = attention.Case(1, 2048, 2, 32, mask, False, "float32")
    mask_mod = attention.case_mask_mod(case) or (lambda b, h, q, k: q >= 0)
    dense = omni_jax.create_block_mask(mask_mod, 1, None, 2048, 2048, 128).to_dense()
    assert attention.visible_pairs(case) == int(np.asarray(dense).sum())


def test_a_value_head_dim_case_shapes_values_and_counts_both_products():
    """A "d192v128" case gives values (and the output gradient) their own head dim, and its
    FLOP count takes each product at its own width."""
    case = attention.Case(1, 64, 2, 48, "causal", True, "float32", value_head_dim=16)
    assert "d48v16 fwd+bwd" in case.name
    q, k, v, dout = attention._inputs(case, 1)[0]
    assert q.shape == k.shape == (1, 64, 2, 48)
    assert v.shape == dout.shape == (1, 64, 2, 16)
    grads = attention._timed_fn(attention.builder("omni_xla")(case), True)(q, k, v, dout)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    same_width = attention.Case(1, 64, 2, 32, "causal", True, "float32")
    assert attention.case_flops(case) == attention.case_flops(same_width)
    with pytest.raises(attention.Unsupported, match="value head dim"):
        attention.builder("jax_xla")(case)


def test_a_case_is_timed_together_and_failures_are_rows(monkeypatch, timed_together):
    """Failures while traced are rows: `Unsupported` a skip, anything else a failure (with
    the output check off, the timing meets them; with it on, the check does, untimed)."""
    groups = timed_together(attention)

    def raising(error):
        def build(case):
            def attend(q, k, v):
                raise error

            return attend

        return build

    monkeypatch.setitem(attention.BUILDERS, "jax_xla",
                        raising(attention.Unsupported("not for this case")))
    monkeypatch.setitem(attention.BUILDERS, "tokamax", raising(RuntimeError("exploded")))
    parser = argparse.ArgumentParser()
    attention.add_arguments(parser)
    impls = ["omni_xla", "jax_xla", "tokamax", "cudnn"]
    for check in (False, True):
        groups.clear()
        args = parser.parse_args(["--tiny", "--cases", "dense b1 s128 h2 d32 fwd", "--impls",
                                  ",".join(impls), "--warmup", "1", "--samples", "2",
                                  "--inner", "1", *([] if check else ["--no-check"])])
        rows = attention.run(args)
        runnable = ["omni_xla"] + ([] if check else ["jax_xla", "tokamax"]) + (
            ["cudnn"] if jax.default_backend() == "gpu" else [])
        assert groups == [runnable] * 2  # fwd and fwd+bwd
        notes = {(row["case"], row["impl"]): row["note"] for row in rows}
        for case in {row["case"] for row in rows}:
            assert notes[case, "jax_xla"] == "skipped: not for this case"
            assert notes[case, "tokamax"] == "failed: RuntimeError: exploded"
        assert all(math.isfinite(row["ms"]) for row in rows if row["impl"] == "omni_xla")


@pytest.mark.parametrize("impl,backward,fields", [
    ("omni_mosaic/pipelined=0", False, {"pipelined": False}),
    ("omni_mosaic/pipelined=1/q_blocks_per_cta=3", False,
     {"pipelined": True, "q_blocks_per_cta": 3}),
    # Backward fields stay forced while the backward is traced, after the forward returned.
    ("omni_mosaic/bwd.dkv_stages=2/bwd.dq_stages=1", True, {"dkv_stages": 2, "dq_stages": 1}),
    # A float field from an integer: the fused dQ's split at every walk length.
    ("omni_mosaic/bwd.fused_dq_min_full_walk=0", True, {"fused_dq_min_full_walk": 0.0}),
    # omni_jax.attention's deterministic=False: the fused dQ (atomic adds) at head dim 128.
    ("omni_mosaic/deterministic=0", True, {"fused_dq": True}),
    ("omni_mosaic/deterministic=1", True, {"fused_dq": False}),
    # A bool field from an integer: the fused dQ's serial step order, for its A/B.
    ("omni_mosaic/deterministic=0/bwd.overlapped_step=0", True, {"overlapped_step": False}),
])
def test_forced_mosaic_impls_force_the_config(impl, backward, fields, monkeypatch):
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    module, kernel = (bwd, "attention_backward") if backward else (fwd, "attention_forward")
    configs = record_configs(monkeypatch, module, kernel)
    case = attention.Case(1, 256, 2, 128, "causal", backward=backward)
    q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    timed = attention._timed_fn(attention.builder(impl)(case), backward)
    jax.eval_shape(timed, *[q] * (4 if backward else 3))
    assert len(configs) == 1
    assert {name: getattr(configs[0], name) for name in fields} == fields


@pytest.mark.parametrize("impl,consumers", [("omni_mosaic", 3),
                                             ("omni_mosaic/num_consumers=2", 2)])
def test_forced_mosaic_impls_set_the_consumer_count(impl, consumers, monkeypatch):
    """The A/B of the dense head-dim-64 forward's CTAs: three consumers by default, two
    (the kernel before them) forced."""
    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    configs = record_configs(monkeypatch, fwd, "attention_forward")
    case = attention.Case(2, 2048, 8, 64, "dense", backward=False)
    q = jax.ShapeDtypeStruct((2, 2048, 8, 64), jnp.bfloat16)
    jax.eval_shape(attention._timed_fn(attention.builder(impl)(case), False), q, q, q)
    assert [c.num_consumers for c in configs] == [consumers]


@pytest.mark.parametrize("impl", ["omni_mosaic/stages=2", "omni_mosaic/pipelined=yes",
                                  "omni_mosaic/bwd.block_q=x", "cuDNN"])
def test_unknown_impls_are_named(impl):
    with pytest.raises(ValueError, match="expected FIELD=N|unknown implementation"):
        attention.builder(impl)


def test_seqs_replace_the_default_cases():
    parser = argparse.ArgumentParser()
    attention.add_arguments(parser)
    cases = attention._selected_cases(parser.parse_args(
        ["--seqs", "1024", "32768", "--forward-only", "--cases", "causal"]))
    assert [(c.batch, c.seq, c.mask, c.backward) for c in cases] == [
        (16, 1024, "causal", False), (1, 32768, "causal", False)]


def _tiny_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    attention.add_arguments(parser)
    return parser.parse_args(["--tiny", "--warmup", "1", "--samples", "1", "--inner", "1",
                              *extra])


@pytest.mark.parametrize("wrong", ["scaled", "nan"])
def test_an_implementation_with_wrong_output_is_reported_and_not_timed(monkeypatch, wrong):
    """A peer is timed only after its output matched the float32 reference."""
    def build(case):
        attend = attention._omni("xla")(case)
        if wrong == "nan":
            return lambda q, k, v: attend(q, k, v) * jnp.nan
        return lambda q, k, v: attend(q, k, v) * 1.5

    monkeypatch.setitem(attention.BUILDERS, "fa3", build)
    rows = attention.run(_tiny_args("--cases", "causal b1 s128 h2 d32 fwd+bwd",
                                    "--impls", "omni_xla,fa3"))
    by_impl = {row["impl"]: row for row in rows}
    assert math.isfinite(by_impl["omni_xla"]["ms"])
    assert math.isnan(by_impl["fa3"]["ms"])
    assert by_impl["fa3"]["note"].startswith("wrong: relative error")


def test_the_ratio_compares_with_the_fastest_named_baseline(monkeypatch):
    rows = attention.run(_tiny_args("--cases", "dense b1 s128 h2 d32 fwd",
                                    "--impls", "omni_xla,jax_xla", "--baseline",
                                    "jax_xla,omni_xla"))
    for row in rows:
        fastest = min(r["ms"] for r in rows if r["case"] == row["case"])
        assert row["ratio"] == pytest.approx(fastest / row["ms"])


@pytest.mark.parametrize("impl", ["fa3", "fa4"])
def test_flash_attention_peers_off_a_gpu_are_skipped_with_a_reason(impl):
    rows = attention.run(_tiny_args("--cases", "causal_documents b1 s128 h2 d32 fwd",
                                    "--impls", f"omni_xla,{impl}"))
    note = {row["impl"]: row["note"] for row in rows}[impl]
    assert note.startswith("skipped:") and ("installed" in note or "GPU" in note), note
