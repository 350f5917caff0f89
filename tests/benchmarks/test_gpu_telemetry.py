"""benchmarks.gpu_telemetry: readings averaged over sample windows."""

from __future__ import annotations

import pytest

from benchmarks import gpu_telemetry


@pytest.fixture(autouse=True)
def _fresh_readings(monkeypatch):
    monkeypatch.setattr(gpu_telemetry, "_readings", [])


def test_summary_averages_the_readings_inside_the_windows():
    for t, clock, power, capped in [(0.5, 1980, 100, False), (1.0, 1700, 650, False),
                                    (1.2, 1500, 700, True), (2.0, 1980, 120, False),
                                    (3.1, 1600, 690, True), (4.0, 1980, 110, False)]:
        gpu_telemetry.record((t, clock, power, capped))
    assert (gpu_telemetry.summary([(0.9, 1.3), (3.0, 3.5)])
            == "SM 1600 MHz, 680 W, power-capped 67%")


def test_summary_is_empty_without_readings_in_the_windows():
    assert gpu_telemetry.summary([(0.0, 1.0)]) == ""
    gpu_telemetry.record((5.0, 1980, 100, False))
    assert gpu_telemetry.summary([(0.0, 1.0)]) == ""
    assert gpu_telemetry.summary([]) == ""


def test_start_reports_false_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(gpu_telemetry, "_process", None)
    monkeypatch.setattr(gpu_telemetry.shutil, "which", lambda name: None)
    assert gpu_telemetry.start() is False


@pytest.mark.parametrize("line, parsed", [
    ("1695, 690.12, 688.40, Active", (1695.0, 688.4, True)),
    ("1980, 71.88, [N/A], Not Active", (1980.0, 71.88, False)),
    ("[N/A], 70.0, 70.0, Not Active", None),
    ("clocks.sm, power.draw", None),
])
def test_lines_of_nvidia_smi_parse(line, parsed):
    assert gpu_telemetry._parse(line) == parsed
