"""SGLang prefill and decode times of a recipe's model at several batch sizes, for ``areal-hex profile``.

The engine is the one the recipe's rollout server would run: upstream's ``SGLangConfig.build_args`` from the
``sglang`` section, the per-GPU-type flags of :func:`server_args_for`, and the radix cache off so every prompt is
really prefilled. Each batch is one ``generate`` call of distinct random token-id prompts, sampled as the
rollout samples (``gconfig``), with ``ignore_eos`` so every sequence runs the requested number of tokens.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_hex_plugin.errors import HexError

if TYPE_CHECKING:
    from areal.api.cli_args import GRPOConfig

# Prompt token ids stay this far from both ends of the vocabulary (special and padding rows).
ID_MARGIN = 100
SEED = 0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
GPU_EXTRA_FIX = (
    "install the GPU profile on the GPU machine: bash scripts/setup.sh --gpu (areal-hex-plugin[gpu] with "
    "upstream's dependency overrides)"
)

Generate = Callable[[list[list[int]], dict[str, Any]], Any]


def engine_args(config: GRPOConfig, tp: int, gpu_type: str, hbm_gb: float | None) -> dict[str, Any]:
    """Keyword arguments of ``sglang.Engine`` for the recipe's rollout server on ``tp`` GPUs from GPU 0."""
    import dataclasses
    from importlib.metadata import PackageNotFoundError

    from areal.api.cli_args import SGLangConfig

    from areal_hex_plugin.areal.sglang_flags import server_args_for

    if tp < 1:
        raise HexError("--rollout-tp", f"must be a positive whole number, got {tp}", "give 1 or more")
    model_path = config.sglang.model_path or config.actor.path
    if not model_path:
        raise HexError("sglang.model_path", "is empty and so is actor.path", "set actor.path to the model")
    sglang_config = dataclasses.replace(config.sglang, model_path=model_path)
    try:
        args = SGLangConfig.build_args(sglang_config=sglang_config, tp_size=tp, base_gpu_id=0)
    except PackageNotFoundError:  # build_args checks sglang's version
        raise HexError("sglang", "is not installed", GPU_EXTRA_FIX) from None
    args = server_args_for(gpu_type, hbm_gb, args)
    # The server gets these as command-line flags, and upstream's get_py_cmd leaves out unset and false values
    # so that sglang's own defaults apply; leaving them out here keeps the engine equal to that server.
    args = {k: v for k, v in args.items() if not _unset(v)}
    args["disable_radix_cache"] = True
    if not _has_tokenizer(model_path):
        args["skip_tokenizer_init"] = True
    return args


def measure_decode(
    config: GRPOConfig,
    *,
    gpu_type: str,
    hbm_gb: float | None,
    tp: int,
    batch_sizes: tuple[int, ...],
    prompt_tokens: int,
    decode_tokens: int,
    repeats: int = 3,
) -> dict[str, Any]:
    """Median prefill (1 token) and generate (``decode_tokens``) times of one SGLang engine per batch size."""
    _check_request(batch_sizes, prompt_tokens, decode_tokens, repeats)
    try:
        import sglang
    except ImportError:
        raise HexError("sglang", "is not installed", GPU_EXTRA_FIX) from None
    from sglang.srt.server_args import ServerArgs

    args = engine_args(config, tp, gpu_type, hbm_gb)
    _check_known(args, ServerArgs, sglang.__version__)
    _check_limits(batch_sizes, prompt_tokens, decode_tokens, args.get("max_running_requests"), None)
    context = args.get("context_length")
    if context and prompt_tokens + decode_tokens > context:
        raise HexError(
            "--prompt-tokens",
            f"{prompt_tokens} prompt + {decode_tokens} decode tokens exceed sglang.context_length={context}",
            "use fewer --prompt-tokens or --decode-tokens",
        )
    _check_gpus(tp)
    vocab = _vocab_size(args["model_path"])
    sampling = _sampling(config.gconfig)

    try:
        engine = sglang.Engine(**args)
    except Exception as exc:  # noqa: BLE001 - any start failure is one message for the person running this
        raise HexError(
            "sglang",
            f"the engine for {args['model_path']} did not start: {type(exc).__name__}: {exc}",
            "read the engine's log above; check actor.path, free GPU memory and sglang.mem_fraction_static",
        ) from None
    try:
        running, kv_tokens = _engine_limits(engine.get_server_info())
        _check_limits(batch_sizes, prompt_tokens, decode_tokens, running, kv_tokens)

        def generate(input_ids: list[list[int]], params: dict[str, Any]) -> Any:
            # return_logprob as the rollout requests it: it adds per-token work to every step.
            try:
                return engine.generate(input_ids=input_ids, sampling_params=params, return_logprob=True)
            except Exception as exc:  # noqa: BLE001 - the engine died mid-measurement
                raise HexError(
                    "sglang",
                    f"a batch of {len(input_ids)} failed: {type(exc).__name__}: {exc}",
                    "read the engine's log above; smaller --batch-sizes need less memory",
                ) from None

        points = time_batches(
            generate,
            batch_sizes=batch_sizes,
            prompt_tokens=prompt_tokens,
            decode_tokens=decode_tokens,
            repeats=repeats,
            vocab_size=vocab,
            sampling=sampling,
        )
    finally:
        engine.shutdown()
    return {
        "engine": f"sglang {sglang.__version__}",
        "tp": tp,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "points": points,
    }


def time_batches(
    generate: Generate,
    *,
    batch_sizes: Sequence[int],
    prompt_tokens: int,
    decode_tokens: int,
    repeats: int,
    vocab_size: int,
    sampling: dict[str, Any],
    clock: Callable[[], float] = time.perf_counter,
) -> list[dict[str, Any]]:
    """The ``points`` of :func:`measure_decode`, timing ``generate(input_ids, sampling_params)`` with ``clock``.

    Each batch size first runs one untimed generate call (kernels compile and CUDA graphs warm per shape).
    """
    _check_request(batch_sizes, prompt_tokens, decode_tokens, repeats)
    if vocab_size <= 2 * ID_MARGIN:
        raise HexError(
            "actor.path",
            f"vocab_size {vocab_size} is too small for random prompts",
            "profile a language model",
        )
    rng = random.Random(SEED)

    def timed(batch: int, new_tokens: int) -> float:
        prompts = [
            [rng.randrange(ID_MARGIN, vocab_size - ID_MARGIN) for _ in range(prompt_tokens)]
            for _ in range(batch)
        ]
        params = {**sampling, "max_new_tokens": new_tokens, "ignore_eos": True}
        start = clock()
        outputs = generate(prompts, params)
        elapsed = clock() - start
        _check_outputs(outputs, batch, new_tokens)
        return elapsed

    points = []
    for batch in batch_sizes:
        timed(batch, decode_tokens)
        prefill, full = [], []
        for _ in range(repeats):
            prefill.append(timed(batch, 1))
            full.append(timed(batch, decode_tokens))
        prefill_s, generate_s = statistics.median(prefill), statistics.median(full)
        points.append(
            {
                "batch": batch,
                "prefill_s": prefill_s,
                "generate_s": generate_s,
                "step_s": (generate_s - prefill_s) / (decode_tokens - 1),
            }
        )
    return points


def _unset(value: Any) -> bool:
    return value is None or value is False or value == "" or (isinstance(value, list) and not value)


def _has_tokenizer(model_path: str) -> bool:
    """False only for a local model folder without tokenizer files (a hub id is assumed to have one)."""
    folder = Path(model_path)
    return not folder.is_dir() or any((folder / name).exists() for name in TOKENIZER_FILES)


def _check_request(batch_sizes: Sequence[int], prompt_tokens: int, decode_tokens: int, repeats: int) -> None:
    if not batch_sizes or min(batch_sizes) < 1:
        raise HexError("--batch-sizes", f"{tuple(batch_sizes)} are not positive batch sizes", "e.g. 1,8,32")
    if prompt_tokens < 1:
        raise HexError("--prompt-tokens", f"must be at least 1, got {prompt_tokens}", "e.g. 1024")
    if decode_tokens < 2:  # step_s divides by decode_tokens - 1
        raise HexError("--decode-tokens", f"must be at least 2, got {decode_tokens}", "e.g. 128")
    if repeats < 1:
        raise HexError("repeats", f"must be at least 1, got {repeats}", "time each batch at least once")


def _check_known(args: dict[str, Any], server_args_cls: type, version: str) -> None:
    """Every key must be a field of sglang's ``ServerArgs`` (a dataclass in the pinned 0.5.10.post1, a msgspec
    struct in later releases)."""
    import dataclasses

    fields = getattr(server_args_cls, "__struct_fields__", None)
    if fields is None:
        fields = [f.name for f in dataclasses.fields(server_args_cls)]
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise HexError(
            f"sglang.{unknown[0]}",
            f"is not an option of sglang {version} (unknown: {', '.join(unknown)})",
            "remove it from the recipe's sglang section or install the pinned sglang (areal-hex-plugin[gpu])",
        )


def _check_limits(
    batch_sizes: Sequence[int],
    prompt_tokens: int,
    decode_tokens: int,
    running: int | None,
    kv_tokens: int | None,
) -> None:
    """A batch must run as one: within the running-request cap and the KV cache, else it would queue."""
    for batch in batch_sizes:
        if running and batch > running:
            raise HexError(
                "--batch-sizes",
                f"batch {batch} is more than the engine's {running} max running requests",
                f"use batch sizes up to {running} (or raise sglang.max_running_requests)",
            )
        if kv_tokens and batch * (prompt_tokens + decode_tokens) > kv_tokens:
            raise HexError(
                "--batch-sizes",
                f"batch {batch} x {prompt_tokens + decode_tokens} tokens does not fit the engine's KV cache "
                f"of {kv_tokens} tokens",
                "use smaller batch sizes or fewer --prompt-tokens/--decode-tokens",
            )


def _engine_limits(info: dict[str, Any]) -> tuple[int | None, int | None]:
    """(max running requests, KV-cache tokens) that a started engine reports, each None when absent."""
    states = info.get("internal_states") or [{}]
    return states[0].get("effective_max_running_requests_per_dp"), info.get("max_total_num_tokens")


def _check_outputs(outputs: Any, batch: int, new_tokens: int) -> None:
    if isinstance(outputs, dict):
        outputs = [outputs]
    metas = [out.get("meta_info", {}) for out in outputs]
    wrong = [m.get("completion_tokens") for m in metas if m.get("completion_tokens") != new_tokens]
    if len(metas) != batch or wrong:
        raise HexError(
            "sglang",
            f"a batch of {batch} asking {new_tokens} tokens each returned {len(metas)} outputs, "
            f"{len(wrong)} with other completion_tokens ({wrong[:3]})",
            "check that the engine honours ignore_eos and max_new_tokens (install the gpu extra: upstream's sglang pin)",
        )
    # The pinned sglang (0.5.10.post1) reports "total_retractions"; later releases say "num_retractions".
    if any(m.get("total_retractions") or m.get("num_retractions") for m in metas):
        raise HexError(
            "--batch-sizes",
            f"batch {batch}: sglang retracted requests (KV cache full), so the batch did not run as one",
            "use smaller batch sizes or fewer --prompt-tokens/--decode-tokens",
        )


def _check_gpus(tp: int) -> None:
    import torch

    count = torch.cuda.device_count()
    if count < tp:
        raise HexError(
            "--rollout-tp", f"is {tp} but this machine has {count} CUDA GPUs", f"use at most {count}"
        )


def _vocab_size(model_path: str) -> int:
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=True)
    vocab = getattr(hf_config, "vocab_size", None) or hf_config.get_text_config().vocab_size
    return int(vocab)


def _sampling(gconfig: Any) -> dict[str, Any]:
    """The sampling parameters upstream's SGLang rollout sends, without the length and stop settings."""
    return {
        "temperature": 0.0 if gconfig.greedy else gconfig.temperature,
        "top_p": gconfig.top_p,
        "top_k": gconfig.top_k,
        "frequency_penalty": gconfig.frequency_penalty,
    }
