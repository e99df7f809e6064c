"""Cost-model benchmark: model evaluations per second, cold (first call per configuration) and memoised.

    .venv/bin/python benchmarks/costmodel.py --json OUT [--repeat N]

Prints (and writes) JSON per kind (``rollout``, ``train``, ``weight_sync``): ``configurations``,
``feasible``, ``cold_evals_per_s`` (a fresh CostModel answering each configuration once) and ``memoised_evals_per_s`` (the
same questions again). Configurations are what a scheduler enumerates on ``recipes/paper/7b.yaml``: every
rollout replica of up to 4 stages over both pools with TP in 1, 2, 4, 8; every training layout of up to 4
stages with DP x TP on one machine or more; weight syncs for replica mixes.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

from report import emit  # benchmarks/report.py, beside this script

from areal_hex_plugin.costmodel import CostModel, RolloutStage, TrainStage
from areal_hex_plugin.specs.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent


def configurations(pools: list[str]) -> tuple[list, list, list]:
    stage_choices = [RolloutStage(p, tp) for p in pools for tp in (1, 2, 4, 8)]
    rollouts = [c for pp in range(1, 5) for c in itertools.product(stage_choices, repeat=pp)]
    train_choices = [
        TrainStage(p, dp, tp) for p in pools for tp in (1, 2, 4, 8) for dp in (1, 2, 4, 8, 16, 32)
    ]
    trains = [c for pp in range(1, 3) for c in itertools.product(train_choices, repeat=pp)]
    replicas = [
        (tuple(RolloutStage(pools[-1], tp) for _ in range(pp)), n)
        for tp in (1, 2, 4)
        for pp in (1, 2)
        for n in (1, 4, 16)
    ]
    # Senders: the bytes of a 7B version from one pool, or split over two stages on both pools.
    syncs = [
        (g, [a, b], s)
        for g in ({pools[0]: 15.2e9}, {pools[0]: 7.6e9, pools[-1]: 7.6e9})
        for a, b in itertools.combinations(replicas, 2)
        for s in ("broadcast", "relay")
    ]
    return rollouts, trains, syncs


def _rate(calls: int, seconds: float) -> float:
    return round(calls / seconds, 1) if seconds > 0 else float("inf")


def bench(repeat: int) -> dict:
    r = load_recipe(ROOT / "recipes/paper/7b.yaml")
    rollouts, trains, syncs = configurations([p.name for p in r.cluster.pools])
    kinds = {
        "rollout": (rollouts, lambda cm, c: cm.rollout(c)),
        "train": (trains, lambda cm, c: cm.train(c)),
        "weight_sync": (syncs, lambda cm, c: cm.weight_sync(*c)),
    }
    out: dict = {"recipe": "recipes/paper/7b.yaml", "repeat": repeat}
    for name, (configs, call) in kinds.items():
        cold = warm = 0.0
        for _ in range(repeat):
            cm = CostModel(r.cluster, r.workload, r.calibration)
            t0 = time.perf_counter()
            for c in configs:
                call(cm, c)
            t1 = time.perf_counter()
            for c in configs:
                call(cm, c)
            t2 = time.perf_counter()
            cold, warm = cold + t1 - t0, warm + t2 - t1
        calls = len(configs) * repeat
        feasible = sum(1 for c in configs if getattr(call(cm, c), "feasible", True))
        out[name] = {
            "configurations": len(configs),
            "feasible": feasible,
            "cold_evals_per_s": _rate(calls, cold),
            "memoised_evals_per_s": _rate(calls, warm),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="OUT", help="also write the results here")
    parser.add_argument("--repeat", type=int, default=3, help="fresh cost models per kind (default 3)")
    args = parser.parse_args(argv)
    result = bench(max(1, args.repeat))
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
