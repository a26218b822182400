"""Convert a job trace of the Tiresias simulator (SymbioticLab/Tiresias, ``simulator/*_job.csv``:
``job_id,num_gpu,submit_time,iterations,model_name,duration,interval``) to raydeck's trace CSV
(:mod:`raydeck.scheduling.simulator.trace`), as ``benchmarks/traces/tiresias_60_job.csv`` was made.

Kept: submission time, duration (seconds) and GPUs. Added, since the trace has none: 2 CPUs per
GPU (as :func:`~raydeck.scheduling.simulator.trace.generate_trace`, so CPUs never bind), one team
(``tiresias``), priority 0, no estimate and no checkpoint interval (the benchmark sets both).

Run: ``.venv/bin/python benchmarks/convert_tiresias_trace.py 60_job.csv OUT.csv``.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from raydeck.scheduling import Resources, TraceJob, write_trace


def convert(source: Path) -> list[TraceJob]:
    """The jobs of a Tiresias ``*_job.csv``, in its order."""
    with source.open(newline="") as handle:
        return [TraceJob(id=f"t{int(row['job_id']):03d}", submit_s=float(row["submit_time"]),
                         duration_s=float(row["duration"]),
                         needs=Resources(cpus=2.0 * int(row["num_gpu"]),
                                         gpus=float(row["num_gpu"])),
                         team="tiresias")
                for row in csv.DictReader(handle)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a Tiresias simulator *_job.csv")
    parser.add_argument("out", type=Path, help="where the raydeck trace CSV goes")
    args = parser.parse_args()
    write_trace(convert(args.source), args.out)


if __name__ == "__main__":
    main()
