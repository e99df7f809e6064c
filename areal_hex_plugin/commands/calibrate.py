"""``areal-hex calibrate``: fit the cost model's per-GPU-type factors to measured runs, record where each came from.

``--baselines FILE`` fits to measured homogeneous AReaL runs (``recipes/paper/baselines.json``: the paper's
phase times, weight syncs and per-GPU cost ratios; ``planner/fit_baselines.py``); ``--profile FILE`` (repeatable)
takes the factors ``areal-hex profile`` measured, which the baseline fit then keeps. The output is a profile JSON
(``hex.calibration.profile``) with a ``sources`` entry per factor, the fitted points, and the check: the planner's
phases on every measured cluster next to the measurements.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from areal_hex_plugin.errors import HexError

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "paper"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("calibrate", help="fit the cost model's factors to baselines and/or profiles")
    parser.add_argument(
        "--baselines", metavar="FILE", help="measured homogeneous runs (areal-hex-baselines/1)"
    )
    parser.add_argument("--profile", metavar="FILE", action="append", default=[], help="an areal-hex profile")
    parser.add_argument(
        "--recipes", metavar="DIR", default=str(RECIPES), help="recipes of the measured models (*.yaml)"
    )
    parser.add_argument(
        "--json", metavar="OUT", required=True, help="where to write the calibration profile; - for stdout"
    )
    parser.set_defaults(run=run)


def _read(path: str, what: str) -> dict:
    try:
        return json.loads(Path(path).expanduser().read_text())
    except OSError as exc:
        raise HexError(what, f"cannot read {path}: {exc.strerror}", "check the path") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise HexError(what, f"{path} is not JSON", "point at the JSON file") from None


def _print_kernel_checks(checks: list[dict], con) -> None:
    """The KV rate measured decode kernels reach beside the ``hbm_fraction`` of each type written that has them
    (nothing is fitted to it)."""
    if not checks:
        return
    print(f"\nhbm_fraction beside measured decode-attention kernels ({checks[0]['source']})", file=con)
    for c in checks:
        kernels = ", ".join(f"{layout} {f:.2f}" for layout, f in c["kernels"].items())
        print(f"  {c['gpu_type']:10} kernels stream KV at {c['kernel_fraction']:.2f} of HBM ({kernels}); "
              f"hbm_fraction {c['hbm_fraction']:g} ({c['hbm_fraction_source']}): the model reads KV "
              f"{c['ratio']:.2f}x slower than the kernels", file=con)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from areal_hex_plugin.costmodel.calibration import (
        PROFILE_FORMAT,
        RANGES,
        Calibration,
        read_profile,
        read_profile_sources,
    )
    from areal_hex_plugin.costmodel.kernel_checks import attention_checks
    from areal_hex_plugin.outfiles import check_writable, console, write_json
    from areal_hex_plugin.planner.fit_baselines import check_baselines, fit_baselines, setting_from
    from areal_hex_plugin.progress import working
    from areal_hex_plugin.sim.baselines import baseline_phases
    from areal_hex_plugin.specs.recipe import load_recipe

    if not args.baselines and not args.profile:
        raise HexError("--baselines", "nothing to fit", "give --baselines FILE, --profile FILE, or both")
    check_writable(args.json, "--json")
    con = console(args.json)
    calibration = Calibration()
    for path in args.profile:
        sources = read_profile_sources(path, "--profile")
        for gpu_type, factors in read_profile(path, "--profile").items():
            for key, value in factors.items():
                calibration = calibration.with_factors(gpu_type, {key: value}, sources[(gpu_type, key)])
    types = sorted({t for t, _ in calibration.overrides})
    out: dict = {"format": PROFILE_FORMAT, "points": [], "check": []}
    if args.baselines:
        data = check_baselines(_read(args.baselines, "--baselines"))
        folder = Path(args.recipes).expanduser()
        recipes = {}
        for file in sorted(folder.glob("*.yaml")):
            recipe = load_recipe(file, [])
            recipes[recipe.workload.model.name] = recipe
        with working(f"fitting {len(recipes)} models to {args.baselines}"):
            fit = fit_baselines(data, {m: setting_from(r) for m, r in recipes.items()}, calibration,
                                Path(args.baselines).name)  # fmt: skip
            calibration = fit.calibration
            types = sorted({*types, *fit.factors})
            out["points"] = fit.points
            out["cluster_gpus"] = fit.gpus
            out["measured_setting"] = fit.setting.as_dict(fit.gpus, {
                name: c.get("rollout_layout") for name, c in data["clusters"].items()})  # fmt: skip
            out["unexplained"] = fit.unexplained
            out["check"] = baseline_phases(recipes, calibration, data, fit.gpus, fit.setting.eta)
    out.update(calibration.profile(types))
    out["kernel_checks"] = attention_checks(calibration, types)
    for t in types:
        print(f"{t}:", file=con)
        for key, value in out["gpu_types"][t].items():
            edge = " [at an end of its range]" if value in (RANGES[key].low, RANGES[key].high) else ""
            print(f"  {key:18} {value:<10g} {out['sources'][t][key]}{edge}", file=con)
    if out["check"]:
        print("\nPlanner vs measured on the measured clusters (the planner's own plan; split: GPUs training + "
              "generating, which may differ from the run's)", file=con)  # fmt: skip
        print(
            f"{'model':32}{'cluster':8}{'phase':15}{'measured':>10}{'model':>10}{'error':>8}  split", file=con
        )
        for row in out["check"]:
            error = row["model_value"] / row["measured"] - 1
            split = " + ".join(str(sum(row["split"][role].values())) for role in ("train", "rollout"))
            print(f"{row['model']:32}{row['cluster']:8}{row['phase']:15}{row['measured']:10.1f}"
                  f"{row['model_value']:10.1f}{error:+8.1%}  {split}", file=con)  # fmt: skip
    for miss in out.get("unexplained", []):
        print(f"\ncannot explain {miss['measurement']}: {miss['measured']:g} measured, {miss['model_value']:.4g} "
              f"with every factor inside its range ({miss['needs']})", file=con)  # fmt: skip
    _print_kernel_checks(out["kernel_checks"], con)
    print(f"\ncalibration written to {write_json(args.json, out)}", file=con)
    return 0
