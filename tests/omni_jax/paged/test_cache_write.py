"""`omni_jax.paged_cache_write` appends where `paged_attention` reads, and nowhere else."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import omni_jax
from tests.omni_jax.paged.paged_reference import random_case


def _gathered(pages, table, b, length):
    return np.asarray(pages)[np.asarray(table)[b]].reshape(-1, *pages.shape[2:])[:length]


@pytest.mark.parametrize("num_new", [1, 7])
def test_appends_after_each_sequence_and_leaves_other_pages(num_new, seed):
    case = random_case(seed, kv_lens=[13, 0, 30], page_size=8, pages_per_seq=6,
                       own_every_slot=True)
    keys = jax.random.split(jax.random.key(seed + 1), 2)
    k_new, v_new = (jax.random.normal(key, (3, num_new, 2, 32)) for key in keys)
    write = jax.jit(omni_jax.paged_cache_write, donate_argnums=(0, 1))
    k_pages, v_pages = write(jnp.copy(case.k_pages), jnp.copy(case.v_pages), case.page_table,
                             case.kv_lens, k_new, v_new)
    touched = np.zeros(k_pages.shape[:2], bool)
    for b, length in enumerate(np.asarray(case.kv_lens)):
        for new, pages, old in ((k_new, k_pages, case.k_pages), (v_new, v_pages, case.v_pages)):
            got = _gathered(pages, case.page_table, b, length + num_new)
            np.testing.assert_array_equal(got[:length], _gathered(old, case.page_table, b,
                                                                  length))
            np.testing.assert_array_equal(got[length:], new[b])
        for pos in range(length, length + num_new):
            touched[case.page_table[b, pos // 8], pos % 8] = True
    np.testing.assert_array_equal(np.asarray(k_pages)[~touched],
                                  np.asarray(case.k_pages)[~touched])


def test_free_slots_and_overflow_under_jit_are_dropped(seed):
    case = random_case(seed, kv_lens=[6, 0], page_size=4, pages_per_seq=2,
                       own_every_slot=True)
    table = case.page_table.at[1].set(-1)  # sequence 1 is a free slot
    new = jnp.ones((2, 3, 2, 32))
    k_pages, _ = jax.jit(omni_jax.paged_cache_write)(case.k_pages, case.v_pages, table,
                                                     case.kv_lens, new, new)
    got = _gathered(k_pages, table, 0, 8)
    np.testing.assert_array_equal(got[6:], 1.0)  # 2 of 3 fit; the third is dropped
    changed = np.asarray(k_pages != case.k_pages).any(axis=(2, 3))
    assert changed.sum() == 2
