"""``areal-hex profile RECIPE --gpu-type X``: measure a GPU type and fit its efficiency factors.

On a machine with that GPU it runs the recipe's model for real: an SGLang engine built from the recipe's
``sglang`` section (prefill and decode at several batch sizes) and upstream's FSDP PPO actor built from its
``actor`` section (log-prob forward and PPO update, plus an all-reduce when several GPUs train). The cost model is
then fitted to those times (``areal_hex_plugin.costmodel.fit``). ``--from-measurements FILE`` fits saved
measurements anywhere. Recipes use the result through ``hex.calibration.profile``.
"""

from __future__ import annotations

import argparse
from typing import Any

from areal_hex_plugin.commands.common import add_recipe_arguments, load_recipe_from_args
from areal_hex_plugin.costmodel.fit import MEASUREMENTS_FORMAT, ProfileFit, fit_profile
from areal_hex_plugin.errors import HexError
from areal_hex_plugin.outfiles import console, write_json

DEFAULT_BATCHES = "1,8,32,128"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("profile", help="measure a GPU type's efficiency factors for the cost model")
    add_recipe_arguments(parser)
    parser.add_argument("--gpu-type", required=True, help="catalog name of the GPU being measured, e.g. H20")
    parser.add_argument("--json", metavar="OUT", required=True, help="where to write the profile JSON")
    rollout = parser.add_argument_group("rollout (SGLang)")
    rollout.add_argument("--rollout-tp", type=int, default=1, help="tensor parallel size of the engine")
    rollout.add_argument("--batch-sizes", default=DEFAULT_BATCHES, help="decode batch sizes, comma-separated")
    rollout.add_argument("--prompt-tokens", type=int, help="prompt length (default: the recipe's)")
    rollout.add_argument("--decode-tokens", type=int, default=128, help="tokens generated per timed batch")
    train = parser.add_argument_group("training (FSDP)")
    train.add_argument(
        "--train-gpus",
        type=int,
        help="GPUs to train on (default: this machine's, at most the pool's per machine)",
    )
    train.add_argument(
        "--train-sequences", type=int, help="sequences per step (default: 2 per GPU per minibatch)"
    )
    train.add_argument("--train-sequence-tokens", type=int, default=4096, help="tokens per training sequence")
    parser.add_argument(
        "--from-measurements", metavar="FILE", help="fit saved measurements instead of measuring"
    )
    parser.set_defaults(run=run)


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes:
        raise HexError("--batch-sizes", f"{text[:80]!r} is not a list of whole numbers", "e.g. 1,8,32,128")
    return sizes


def _pool(recipe, gpu_type: str, gpus: int):
    """The recipe's pool of ``gpu_type`` (its link figures), or one machine of it with catalog figures."""
    from areal_hex_plugin.specs.cluster import Pool

    gpu = recipe.catalog.get(gpu_type, "--gpu-type")
    for pool in recipe.cluster.pools:
        if pool.gpu_type == gpu.name:
            return pool
    inter = recipe.cluster.cross_pool_gb_per_s
    return Pool(gpu.name.lower(), gpu, max(gpus, 8), 1, (), 0.0, gpu.link_gb_per_s, inter)


def _read_measurements(path: str) -> dict:
    from areal_hex_plugin.costmodel.measurements import check_measurements
    from areal_hex_plugin.specs.files import read_json

    data = read_json(path, "--from-measurements", "give a file written by areal-hex profile")
    if isinstance(data, dict) and isinstance(data.get("measurements"), dict):
        data = next(iter(data["measurements"].values()), None)  # a whole profile: take its measurements
    if not isinstance(data, dict) or data.get("format") != MEASUREMENTS_FORMAT:
        raise HexError(
            "--from-measurements", f"{path} holds no measurements", f"expected format {MEASUREMENTS_FORMAT!r}"
        )
    check_measurements(data, "measurements")
    return data


def _measure(args: argparse.Namespace, recipe, pool) -> dict[str, Any]:
    """Run the recipe's model on this machine's GPUs (SGLang, then FSDP)."""
    import torch

    from areal_hex_plugin.areal.preflight import load_upstream_config, upstream_keys
    from areal_hex_plugin.areal.profile_decode import measure_decode
    from areal_hex_plugin.areal.profile_train import check_request, measure_train
    from areal_hex_plugin.specs.overrides import checked_overrides

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = args.train_gpus or max(1, min(pool.gpus_per_machine, visible))
    minibatches = recipe.workload.rl.ppo_n_minibatches
    sequences = args.train_sequences or 2 * gpus * minibatches
    # As a run loads it (load_expr_config), with upstream's errors as one message naming the key.
    overrides = checked_overrides(args.overrides, upstream_keys)
    config = load_upstream_config(str(recipe.path), overrides, save=True)
    check_request(config, gpus, sequences, args.train_sequence_tokens)
    device = _local_gpu(recipe, pool.gpu_type)
    decode = measure_decode(
        config,
        gpu_type=pool.gpu_type,
        hbm_gb=pool.gpu.hbm_gb,
        tp=args.rollout_tp,
        batch_sizes=_batch_sizes(args.batch_sizes),
        prompt_tokens=args.prompt_tokens or recipe.workload.prompt_tokens,
        decode_tokens=args.decode_tokens,
    )
    train = measure_train(config, gpus=gpus, sequences=sequences, sequence_tokens=args.train_sequence_tokens)
    return {
        "format": MEASUREMENTS_FORMAT,
        "gpu_type": pool.gpu_type,
        "device_name": device,
        "model": recipe.workload.model.name,
        "decode": decode,
        "train": {**train, "minibatches": minibatches},
    }


def _local_gpu(recipe, gpu_type: str) -> str:
    """The name of this machine's CUDA GPU, which must be ``gpu_type``."""
    import torch

    if not torch.cuda.is_available():
        raise HexError(
            "--gpu-type",
            f"no CUDA GPU on this machine to measure {gpu_type}",
            "run this on a machine with that GPU, or pass --from-measurements FILE",
        )
    name = torch.cuda.get_device_name()
    if name in recipe.catalog and recipe.catalog.get(name).name != gpu_type:
        raise HexError(
            "--gpu-type", f"is {gpu_type} but this machine has {name}", "name the GPU this machine has"
        )
    return name


def _report(gpu_type: str, fit: ProfileFit) -> str:
    lines = [f"{gpu_type} factors: " + ", ".join(f"{k}={v:.3f}" for k, v in fit.factors.items())]
    lines.append(f"{'measured':<12}{'batch':>6}{'measured s':>12}{'model s':>12}{'error':>8}")
    for p in fit.points:
        error = p["model_s"] / p["measured_s"] - 1
        lines.append(
            f"{p['what']:<12}{p['batch']:>6}{p['measured_s']:>12.4g}{p['model_s']:>12.4g}{error:>8.1%}"
        )
    lines.append(
        f"fit: rms log error {fit.rms_log_error:.3f}; engine cost per prefill call {fit.prefill_call_s * 1e3:.1f} ms"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from areal_hex_plugin.costmodel.calibration import PROFILE_FORMAT
    from areal_hex_plugin.costmodel.measurements import DecodeMeasurements, DecodePoint, TrainMeasurements
    from areal_hex_plugin.specs.typed import meta_of, scalar

    # Each flag sets a field of the measurements it will write: the same range holds.
    for value, flag, (cls, name) in (
        (args.rollout_tp, "--rollout-tp", (DecodeMeasurements, "tp")),
        (args.prompt_tokens, "--prompt-tokens", (DecodeMeasurements, "prompt_tokens")),
        (args.decode_tokens, "--decode-tokens", (DecodeMeasurements, "decode_tokens")),
        (args.train_gpus, "--train-gpus", (TrainMeasurements, "gpus")),
        (args.train_sequences, "--train-sequences", (TrainMeasurements, "sequences")),
        (args.train_sequence_tokens, "--train-sequence-tokens", (TrainMeasurements, "sequence_tokens")),
        *((size, "--batch-sizes", (DecodePoint, "batch")) for size in _batch_sizes(args.batch_sizes)),
    ):
        if value is not None:
            scalar(int, value, flag, meta_of(cls, name))
    recipe = load_recipe_from_args(args)
    pool = _pool(recipe, args.gpu_type, args.train_gpus or 0)
    if args.from_measurements:
        measurements = _read_measurements(args.from_measurements)
        if measurements.get("gpu_type", pool.gpu_type) != pool.gpu_type:
            raise HexError(
                "--gpu-type",
                f"is {pool.gpu_type} but the measurements are of {measurements['gpu_type']}",
                f"pass --gpu-type {measurements['gpu_type']}",
            )
    else:
        measurements = _measure(args, recipe, pool)
    fit = fit_profile(pool, recipe.workload.model, measurements, recipe.calibration)
    name = pool.gpu_type
    document = {
        "format": PROFILE_FORMAT,
        "gpu_types": {name: fit.factors},
        "fit": {
            name: {
                "rms_log_error": round(fit.rms_log_error, 4),
                "prefill_call_s": round(fit.prefill_call_s, 6),
                "points": fit.points,
            }
        },
        "measurements": {name: measurements},
    }
    where = write_json(args.json, document)
    out = console(args.json)
    print(_report(name, fit), file=out)
    print(f"wrote {where}; use it with hex.calibration.profile={where}", file=out)
    return 0
