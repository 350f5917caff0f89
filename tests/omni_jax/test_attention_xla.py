"""The shared attention suite on the XLA backend, plus what only the reference backend does."""

import jax

from tests.omni_jax.attention_suite import AttentionSuite, Case, check_case


class TestXlaAttention(AttentionSuite):
    implementation = "xla"


def test_float64_is_exact():
    with jax.enable_x64(True):
        for case in (Case("causal_ragged", q_len=45, kv_len=77, is_causal=True, sinks=True),
                     Case("documents", q_len=80, kv_len=80, segments="packed",
                          score_mod="alibi")):
            check_case("xla", case, "float64", (32, 32))
