"""Where a kernel's warps stall, from ncu's per-instruction samples.

Reads the source page of a report profiled with ``--section SourceCounters`` and prints,
per kernel: the stall reasons over all samples, each loop (a backward branch and its
target) with its share and reasons, and the instructions with the most samples. A loop
tells apart roles that wait by design (a producer warp spinning on an mbarrier: the
branch after ``SYNCS.PHASECHK`` waits on the long scoreboard) from the consumers' step.

    ncu --profile-from-start off --section SourceCounters --section WarpStateStats -o prof \\
        python scripts/ncu_attention.py --impls omni_mosaic --case "dense b4 s4096 h16 d128 fwd+bwd"
    ncu -i prof.ncu-rep --page source --csv --print-source sass > source.csv
    python scripts/ncu_stalls.py source.csv
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import re
from collections.abc import Iterable, Iterator

SAMPLES = "Warp Stall Sampling (All Samples)"
_BRANCH = re.compile(r"\bBRA\s+(0x[0-9a-fA-F]+)")


@dataclasses.dataclass(frozen=True)
class Instruction:
    address: int
    source: str
    samples: int
    reasons: dict[str, int]  # stall reason (without "stall_") -> samples


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    instructions: list[Instruction]

    @property
    def samples(self) -> int:
        return sum(i.samples for i in self.instructions)

    def loops(self) -> list[tuple[int, int]]:
        """(first, last) instruction index of each loop: a predicated branch back to an
        earlier instruction (unpredicated ones return from out-of-line wait stubs)."""
        index = {inst.address: n for n, inst in enumerate(self.instructions)}
        loops = []
        for n, inst in enumerate(self.instructions):
            match = _BRANCH.search(inst.source) if inst.source.startswith("@") else None
            target = index.get(int(match.group(1), 16)) if match else None
            if target is not None and target <= n:
                loops.append((target, n))
        return loops


def read_kernels(lines: Iterable[str]) -> Iterator[Kernel]:
    """The kernels of an ncu source-page CSV (``"Kernel Name",...`` starts each)."""
    name, header, instructions = None, None, []
    for row in csv.reader(lines):
        if not row:
            continue
        if row[0] == "Kernel Name":
            if name is not None:
                yield Kernel(name, instructions)
            name, header, instructions = row[1], None, []
        elif header is None:
            header = row
        elif len(row) == len(header):
            values = dict(zip(header, row, strict=True))
            reasons = {key[len("stall_"):]: int(value or 0) for key, value in values.items()
                       if key.startswith("stall_") and "Not Issued" not in key}
            samples = int(values[SAMPLES] or 0)
            # Samples of reasons the CSV has no column for (an HGMMA waiting to issue).
            reasons["unlisted"] = max(samples - sum(reasons.values()), 0)
            instructions.append(Instruction(int(values["Address"], 16),
                                            values["Source"].strip(), samples, reasons))
    if name is not None:
        yield Kernel(name, instructions)


def reason_totals(instructions: Iterable[Instruction]) -> dict[str, int]:
    """Samples per stall reason, largest first."""
    totals: dict[str, int] = {}
    for inst in instructions:
        for reason, count in inst.reasons.items():
            totals[reason] = totals.get(reason, 0) + count
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def _reasons(totals: dict[str, int], total: int, count: int = 4) -> str:
    top = [(reason, n) for reason, n in totals.items() if n][:count]
    return ", ".join(f"{reason} {n / max(total, 1):.0%}" for reason, n in top)


def report(kernel: Kernel, top: int = 30) -> str:
    total = kernel.samples
    lines = [f"{kernel.name}: {total} samples, {len(kernel.instructions)} instructions",
             f"  reasons: {_reasons(reason_totals(kernel.instructions), total, 8)}"]
    for first, last in kernel.loops():
        body = kernel.instructions[first:last + 1]
        samples = sum(i.samples for i in body)
        if samples >= total / 1000:
            lines.append(f"  loop [{first}, {last}] ({last - first + 1} instructions): "
                         f"{samples / total:.1%} of samples; "
                         f"{_reasons(reason_totals(body), samples)}")
    lines.append(f"  top {top} instructions (index, share, reasons):")
    ranked = sorted(enumerate(kernel.instructions), key=lambda item: -item[1].samples)
    for n, inst in ranked[:top]:
        reasons = dict(sorted(inst.reasons.items(), key=lambda item: -item[1]))
        lines.append(f"  {n:6d} {inst.samples / total:6.1%}  {inst.source[:60]:60s} "
                     f"{_reasons(reasons, inst.samples, 2)}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--top", type=int, default=30, help="instructions listed per kernel")
    args = parser.parse_args()
    with open(args.csv, newline="") as f:
        for kernel in read_kernels(f):
            print(report(kernel, args.top))


if __name__ == "__main__":
    main()
