"""Bad paged-cache arguments raise at trace time, naming the argument and the values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax
from tests.omni_jax.paged.paged_reference import random_case


def _case():
    return random_case(0, kv_lens=[20, 5], page_size=8, pages_per_seq=3)


def _replace(**changes):
    case = _case()
    args = dict(q=case.q, k_pages=case.k_pages, v_pages=case.v_pages,
                page_table=case.page_table, kv_lens=case.kv_lens)
    args.update({name: change(args[name]) if callable(change) else change
                 for name, change in changes.items()})
    return args


@pytest.mark.parametrize("changes,kwargs,error,match", [
    (dict(q=lambda q: q[0]), {}, ValueError, r"q must have rank 4"),
    (dict(q=lambda q: q.astype(jnp.bfloat16)), {}, TypeError, r"q must have the pages' dtype"),
    (dict(q=lambda q: q[:, :, :3]), {}, ValueError, r"multiple of the pages' num_kv_heads 2"),
    (dict(q=lambda q: q[:1]), {}, ValueError, r"page_table's batch 2"),
    (dict(q=lambda q: q[..., :16]), {}, ValueError, r"head_dim 32, got 16"),
    (dict(k_pages=lambda k: k.astype(jnp.int32)), {}, TypeError, r"k_pages must be bfloat16"),
    (dict(v_pages=lambda v: v[:-1]), {}, ValueError, r"must agree on \[num_pages"),
    (dict(v_pages=lambda v: v.astype(jnp.float16)), {}, TypeError, r"v_pages must have"),
    (dict(page_table=lambda t: t.astype(jnp.float32)), {}, TypeError, r"page_table must be an"),
    (dict(page_table=lambda t: t[0]), {}, ValueError, r"page_table must have rank 2"),
    (dict(kv_lens=lambda n: n[:1]), {}, ValueError, r"kv_lens must have shape \[batch\] = \(2,\)"),
    (dict(kv_lens=jnp.array([25, 5])), {}, ValueError,
     r"kv_lens\[0\] = 25 must lie in \[0, pages_per_seq \* page_size\] = \[0, 24\]"),
    (dict(kv_lens=jnp.array([20, -1])), {}, ValueError, r"kv_lens\[1\] = -1"),
    # numpy's default int64: values past int32 must not wrap onto valid ones.
    (dict(kv_lens=np.array([20, 5 + 2**32])), {}, ValueError,
     r"kv_lens\[1\] = 4294967301 does not fit int32"),
    (dict(page_table=lambda t: np.asarray(t, np.int64) + np.array([[0, 0, 2**32], [0, 0, 0]])),
     {}, ValueError, r"page_table\[0, 2\] = \d+ does not fit int32"),
    (dict(page_table=lambda t: t.at[0, 2].set(99)), {}, ValueError,
     r"page_table\[0, 2\] = 99 holds tokens of sequence 0 but is not a page"),
    ({}, dict(is_causal=1), TypeError, r"is_causal must be a Python bool"),
    ({}, dict(local_window_size=(-1, 0)), ValueError, r"local_window_size"),
    ({}, dict(softcap=-1.0), ValueError, r"softcap must be a finite positive"),
    ({}, dict(sinks=jnp.zeros(3)), ValueError, r"sinks must have shape \[num_q_heads\]"),
    ({}, dict(implementation="cuda"), ValueError, r"implementation must be one of"),
    # float32 (or, without a GPU or the interpreter, the machine)
    ({}, dict(implementation="mosaic"), ValueError, r"implementation='mosaic' cannot serve"),
])
def test_bad_arguments_raise_clearly(changes, kwargs, error, match):
    with pytest.raises(error, match=match):
        omni_jax.paged_attention(**_replace(**changes), **kwargs)


def test_a_free_table_slot_past_the_length_is_not_checked():
    args = _replace(page_table=lambda t: t.at[1, 2].set(-1))  # sequence 1 uses one page
    omni_jax.paged_attention(**args)


def test_no_derivative():
    args = _replace()
    loss = lambda q: omni_jax.paged_attention(q, *list(args.values())[1:]).sum()
    with pytest.raises(NotImplementedError, match="paged_attention has no derivative"):
        jax.grad(loss)(args["q"])


@pytest.mark.parametrize("changes,match", [
    (dict(k_new=lambda k: k[:, :, :1]), r"k_new must have shape \[batch, num_new"),
    (dict(v_new=lambda v: v.astype(jnp.bfloat16)), r"v_new must have the pages' dtype"),
    (dict(kv_lens=jnp.array([20, 5])), r"kv_lens\[0\] = 20 plus 5 new tokens must lie"),
])
def test_bad_cache_writes_raise(changes, match):
    case = _case()
    new = jnp.ones((2, 5, 2, 32))
    args = dict(k_pages=case.k_pages, v_pages=case.v_pages, page_table=case.page_table,
                kv_lens=jnp.array([10, 5]), k_new=new, v_new=new)
    args.update({name: change(args[name]) if callable(change) else change
                 for name, change in changes.items()})
    with pytest.raises((ValueError, TypeError), match=match):
        omni_jax.paged_cache_write(**args)
