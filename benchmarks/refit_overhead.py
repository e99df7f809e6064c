"""What the online refit costs a live run (issue 34: off the critical path): the CPU e2e run with the loop on
(``hex.calibration.refit_every`` at its default) and off (0), in turns, on the same machine.

Each run is the real driver on ``recipes/ci/tiny.yaml`` (``hex_local``, the SGLang stand-in, FSDP on gloo; the
e2e tests' assets, ``tests/e2e/run.py``), for ``--steps`` steps. Reported per run: its wall seconds, the CPU
seconds of the driver and every process it started and waited for (the trainer, the servers, the refit worker:
on a shared machine a steadier figure than seconds of wall time), the median of ``hex/measured/step_s`` after the
first two steps, and the refit figures it logged; then the medians per setting, each trial's on/off ratio and
their median (runs alternate, so load drifts hit both alike). Run from the repository root:

    .venv/bin/python benchmarks/refit_overhead.py --steps 12 --trials 3 --json refit_overhead.json
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from report import emit  # benchmarks/report.py, beside this script

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the e2e tests' driver runs (tests/e2e/run.py)

SETTINGS = {"loop_on": (), "loop_off": ("hex.calibration.refit_every=0",)}
WARMUP_STEPS = 2


def one_run(label: str, steps: int) -> dict:
    from tests.e2e.run import environment, new_mark, run_driver

    folder = Path(tempfile.mkdtemp(prefix=f"hex-refit-{label}-"))
    try:
        env = environment(folder, new_mark(), {"HEX_LOCAL_GPUS": "CPU-BIG:3,CPU-SMALL:2"})
        before = _children_cpu_s()
        run = run_driver(folder, "hex_local", steps, env, 600, SETTINGS[label])
        cpu_s = _children_cpu_s() - before
        history = run.wandb_history()
        step_s = [r["hex/measured/step_s"] for r in history if "hex/measured/step_s" in r]
        refits = [r for r in history if "hex/calibration/cpu_s" in r]
        return {
            "setting": label,
            "returncode": run.returncode,
            "run_s": round(run.seconds, 1),
            "cpu_s": round(cpu_s, 1),
            "median_step_s": round(statistics.median(step_s[WARMUP_STEPS:]), 3),
            "refits_logged": len(refits),
            "refit_cpu_s": [round(r["hex/calibration/cpu_s"], 3) for r in refits],
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _children_cpu_s() -> float:
    """CPU seconds of the processes this one started and waited for (and theirs, waited for by them)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps per run (default 12)")
    parser.add_argument("--trials", type=int, default=3, help="runs per setting, alternating (default 3)")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    runs = [one_run(label, args.steps) for _ in range(args.trials) for label in SETTINGS]
    medians = {
        label: {
            key: statistics.median(r[key] for r in runs if r["setting"] == label)
            for key in ("run_s", "cpu_s", "median_step_s")
        }
        for label in SETTINGS
    }
    # Each trial's on run beside the off run that followed it: the median of those ratios.
    pairs = list(zip(runs[0::2], runs[1::2], strict=True))
    emit(
        {
            "runs": runs,
            "medians": medians,
            "step_s_on_over_off": [round(a["median_step_s"] / b["median_step_s"], 3) for a, b in pairs],
            "median_step_s_on_over_off": round(
                statistics.median(a["median_step_s"] / b["median_step_s"] for a, b in pairs), 3
            ),
            "median_run_s_on_over_off": round(
                statistics.median(a["run_s"] / b["run_s"] for a, b in pairs), 3
            ),
            "median_cpu_s_on_over_off": round(
                statistics.median(a["cpu_s"] / b["cpu_s"] for a, b in pairs), 3
            ),
        },
        args.json,
    )


if __name__ == "__main__":
    main()
