"""Running Mosaic-GPU kernels under the interpreter in tests: interpret mode on, races fail.

`interpreted_mosaic` (a pytest fixture body) switches ``OMNI_JAX_PALLAS_INTERPRET`` on
and fails the test when the interpreter's race detector reported a data race in any
kernel the test ran: the interpreter records races instead of raising.
"""

from __future__ import annotations

import pytest

from pallas_kernels import runtime


def interpreted_mosaic(monkeypatch: pytest.MonkeyPatch):
    """Generator for a fixture: interpret mode, and no race in any interpreted kernel."""
    from jax._src.pallas.mosaic.interpret import race_detection_state
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    races: list[str] = []

    class RecordingRaces(race_detection_state.RaceDetectionState):
        """Remembers every race past the next kernel (which replaces the state)."""

        def __setattr__(self, name, value):
            if name == "races_found" and value:
                races.append("race")
            super().__setattr__(name, value)

    monkeypatch.setenv(runtime.INTERPRET_ENV_VAR, "1")
    monkeypatch.setattr(gpu_callbacks, "RaceDetectionState", RecordingRaces)
    try:
        yield
    except Exception:
        runtime.reset_mosaic_interpreter()
        raise
    assert not races, "the Mosaic-GPU interpreter detected a data race"
