"""Running Mosaic-GPU kernels under the interpreter in tests: interpret mode on, races fail.

`interpreted_mosaic` (a pytest fixture body) switches ``OMNI_JAX_PALLAS_INTERPRET`` on
and fails the test when the interpreter's race detector reported a data race in any
kernel the test ran: the interpreter records races instead of raising.
"""

from __future__ import annotations

import pytest

from pallas_kernels import runtime


def interpreted_mosaic(monkeypatch: pytest.MonkeyPatch, architecture: str = "sm90"):
    """Generator for a fixture: interpret mode (as the ``architecture`` GPU, "sm90" or
    "sm100"), and no race in any interpreted kernel."""
    from jax._src.pallas.mosaic.interpret import race_detection_state

    races: list[str] = []
    state = race_detection_state.RaceDetectionState
    base_setattr = state.__setattr__

    def recording_setattr(self, name, value):
        """Remembers every race past the next kernel (which replaces the state). Patched on
        the base class: jax 0.10 instantiates it, later releases a GPU subclass."""
        if name == "races_found" and value:
            races.append("race")
        base_setattr(self, name, value)

    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1" if architecture == "sm90" else architecture)
    monkeypatch.setattr(state, "__setattr__", recording_setattr)
    try:
        yield
    except Exception:
        runtime.reset_mosaic_interpreter()
        raise
    assert not races, "the Mosaic-GPU interpreter detected a data race"
