"""Benchmark results: a printed table, CSV/JSON files, plots, and a RESULTS.md block.

Every benchmark module returns rows ``{"case", "impl", "ms", "tflops", "ratio",
"note"}`` (see the brief's convention). Plots read the sequence length, mask
type and GEMM shape from optional row keys (``seq_len``, ``mask``, ``m``/``n``/
``k``, ``bytes``) or, failing that, from the case string (``seq=4096``,
``m=4096 n=4096 k=4096``), so modules need nothing beyond the convention.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import platform
import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FIELDS = ("case", "impl", "ms", "tflops", "ratio", "note")
Row = dict[str, Any]

# Nominal dense bf16 peaks and HBM bandwidths (vendor spec sheets) for the roofline plot.
DEVICE_PEAKS = {
    "H100": (989e12, 3.35e12),
    "H200": (989e12, 4.8e12),
    "B200": (2250e12, 8.0e12),
}


def environment() -> dict[str, str]:
    """Date, device and versions, printed before and recorded beside every result."""
    import jax
    import jaxlib

    device = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"{device.device_kind} ({device.platform}, {jax.device_count()} device(s))",
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
    }


def check_rows(name: str, rows: Sequence[Row]) -> list[Row]:
    """Rows with every convention field present (missing optional ones as None / "")."""
    checked = []
    for row in rows:
        missing = {"case", "impl", "ms"} - set(row)
        if missing:
            raise ValueError(f"benchmark {name!r} returned a row without {sorted(missing)}: "
                             f"{row}")
        checked.append({"tflops": None, "ratio": None, "note": "", **row})
    return checked


def _number(value: Any, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def format_table(rows: Sequence[Row], markdown: bool = False) -> str:
    """Rows as an aligned text table (or a markdown table)."""
    header = ("case", "impl", "ms", "TFLOP/s", "ratio", "note")
    body = [(str(r["case"]), str(r["impl"]), _number(r["ms"], 3),
             _number(r["tflops"], 1 if (r["tflops"] or 0) >= 10 else 3),
             _number(r["ratio"], 2), str(r.get("note") or "")) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
                  for cells in body]
        return "\n".join(lines)
    widths = [max(len(c) for c in column) for column in zip(header, *body, strict=True)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(c) for c in body])


def write_csv(rows: Sequence[Row], path: Path) -> None:
    extra = sorted({key for row in rows for key in row} - set(FIELDS))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*FIELDS, *extra])
        writer.writeheader()
        writer.writerows(rows)


def write_json(rows: Sequence[Row], path: Path, meta: dict) -> None:
    path.write_text(json.dumps({"meta": meta, "rows": list(rows)}, indent=1, default=str))


# -- parsing shapes out of rows -------------------------------------------------------------

_SEQ = re.compile(r"\b(?:seq_len|seqlen|seq|s|n|len|kv_len)\s*[=:]?\s*(\d+)", re.IGNORECASE)
_SIZE = re.compile(r"\b\w+\s*[=:]\s*\d+")  # any "name=number" (batch, heads, head_dim, ...)
_DIM = re.compile(r"\b([mnk])\s*[=:]\s*(\d+)", re.IGNORECASE)
_MNK = re.compile(r"(\d+)x(\d+)x(\d+)")
_BATCH = re.compile(r"\bb\d+\b")  # "b4": batch shrinks as seq grows at fixed tokens


def sequence_length(row: Row) -> int | None:
    if row.get("seq_len") is not None:
        return int(row["seq_len"])
    match = _SEQ.search(str(row["case"]))
    return int(match.group(1)) if match else None


def mask_type(row: Row) -> str:
    """The row's mask / variant: its ``mask`` key, else the case without its sizes."""
    if row.get("mask"):
        return str(row["mask"])
    rest = _BATCH.sub("", _SIZE.sub("", _SEQ.sub("", str(row["case"]))))
    return re.sub(r"[\s,_/-]+", " ", rest).strip() or "attention"


def gemm_shape(row: Row) -> tuple[int, int, int] | None:
    if all(row.get(d) is not None for d in "mnk"):
        return int(row["m"]), int(row["n"]), int(row["k"])
    dims = {d.lower(): int(v) for d, v in _DIM.findall(str(row["case"]))}
    if set(dims) == {"m", "n", "k"}:
        return dims["m"], dims["n"], dims["k"]
    match = _MNK.search(str(row["case"]))
    return tuple(int(x) for x in match.groups()) if match else None


def _dtype_bytes(row: Row) -> int:
    text = f"{row.get('dtype', '')} {row['case']}".lower()
    if "fp8" in text or "float8" in text or "e4m3" in text:
        return 1
    if "f32" in text or "float32" in text:
        return 4
    return 2


# -- plots ----------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_attention(rows: Sequence[Row], path: Path, title: str) -> bool:
    """TFLOP/s against sequence length, one panel per mask type, one line per impl."""
    groups: dict[str, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        seq = sequence_length(row)
        if seq is not None and row.get("tflops"):
            groups[mask_type(row)][row["impl"]].append((seq, row["tflops"]))
    if not groups:
        return False
    plt = _pyplot()
    cols = min(3, len(groups))
    nrows = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    all_impls = sorted({impl for impls in groups.values() for impl in impls})
    colors = {impl: f"C{i % 10}" for i, impl in enumerate(all_impls)}  # one color per impl
    for ax, (mask, impls) in zip(axes.flat, sorted(groups.items()), strict=False):
        for impl, points in sorted(impls.items()):
            ax.plot(*zip(*sorted(points), strict=True), "o-", label=impl, color=colors[impl])
        ax.set_xscale("log", base=2)
        ax.set_title(mask)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_matmul(rows: Sequence[Row], path: Path, title: str, device: str) -> bool:
    """Roofline-style: TFLOP/s against arithmetic intensity (FLOP per byte moved)."""
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        shape = gemm_shape(row)
        if shape is None or not row.get("tflops"):
            continue
        m, n, k = shape
        moved = row.get("bytes") or _dtype_bytes(row) * (m * k + k * n + m * n)
        series[row["impl"]].append((2 * m * n * k / moved, row["tflops"]))
    if not series:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for impl, points in sorted(series.items()):
        ax.plot(*zip(*sorted(points), strict=True), "o", label=impl)
    peak = next((p for name, p in DEVICE_PEAKS.items() if name in device), None)
    if peak is not None:
        flops, bandwidth = peak
        xs = [x for points in series.values() for x, _ in points]
        grid = [min(xs) / 2 * (max(xs) * 4 / min(xs)) ** (i / 99) for i in range(100)]
        ax.plot(grid, [min(flops, bandwidth * x) / 1e12 for x in grid], "k--", lw=1,
                label="roofline (nominal)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_bars(rows: Sequence[Row], path: Path, title: str) -> bool:
    """TFLOP/s per case, one bar per impl (for benchmarks without a natural x axis)."""
    cases = list(dict.fromkeys(str(r["case"]) for r in rows if r.get("tflops")))
    impls = list(dict.fromkeys(r["impl"] for r in rows if r.get("tflops")))
    if not cases:
        return False
    value = {(str(r["case"]), r["impl"]): r["tflops"] for r in rows if r.get("tflops")}
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cases)), 4.5))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        ax.bar([c + i * width for c in range(len(cases))],
               [value.get((case, impl), 0) for case in cases], width, label=impl)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))], cases, rotation=30,
                  ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot(name: str, rows: Sequence[Row], path: Path, device: str) -> bool:
    """The plot that suits benchmark ``name``; False when rows hold nothing to plot."""
    title = f"{name} on {device}"
    if name == "matmul" and plot_matmul(rows, path, title, device):
        return True
    if name == "attention" and plot_attention(rows, path, title):
        return True
    return plot_bars(rows, path, title)


# -- markdown for benchmarks/RESULTS.md -----------------------------------------------------


def markdown_block(results: dict[str, list[Row]], meta: dict, command: str) -> str:
    """A section ready to paste into benchmarks/RESULTS.md."""
    lines = [f"## {meta['date']}: {meta['device']}", "",
             f"jax {meta['jax']}, jaxlib {meta['jaxlib']}, Python {meta['python']}", "",
             f"Command: `{command}`", ""]
    for name, rows in results.items():
        lines += [f"### {name}", "", format_table(rows, markdown=True), ""]
    lines.append("ratio = baseline peer's ms / this impl's ms (above 1: faster than the "
                 "baseline).")
    return "\n".join(lines) + "\n"


def save(name: str, rows: Sequence[Row], out_dir: Path, meta: dict,
         plots: bool = True) -> list[Path]:
    """Writes ``<name>.csv``, ``<name>.json`` and ``<name>.png``; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.csv", out_dir / f"{name}.json"]
    write_csv(rows, paths[0])
    write_json(rows, paths[1], {**meta, "benchmark": name})
    if plots and plot(name, rows, out_dir / f"{name}.png", meta["device"]):
        paths.append(out_dir / f"{name}.png")
    return paths
