"""The rollout server of the CPU end-to-end runs, the one stand-in in the loop (SGLang cannot run on CPU): the
transport tests' SGLang stand-in (``tests/transport/sglang_standin.py``) plus a transformers model on CPU that
``/generate``s token by token (sampling parameters, per-token log-probs) with the weights it was last given, and
answers pause, continue, abort, health, server-info, metrics and weight-version calls as SGLang does, as upstream's
``SGLangBackend``/``RemoteSGLangEngine`` and the relay transport's sink call them.

Tensor parallelism as far as one CPU process allows: a load slices every tensor into ``--tp-size`` shards the way
SGLang's loaders do (``TensorParallelSink``), and each forward step computes from those shards as SGLang's TP
ranks would: column-parallel projections per rank then gathered, row-parallel ones as per-rank partial sums
added up (the all-reduce), the vocabulary-parallel embedding as masked per-rank lookups added up. At most
``--max-running-requests`` requests decode at once; the others wait, as in SGLang's queue.

Its speed is set by a "true" catalog kept apart from the recipe's ``hex.gpu_catalog`` (the run's belief):
with ``HEX_STANDIN_TRUTH=FILE`` (``recipe:`` the recipe giving the shapes, ``gpu_catalog:`` the true figures; e.g.
``tests/e2e/truth.yaml``) each token it makes takes at least 1 / the cost model's tokens/s of its server's shape
(pool ``HEX_POOL``, ``--tp-size``) on that catalog at the requests decoding then, so it decodes at the true
model's speed wherever the CPU computes faster. ``/metrics``'s ``gen_throughput`` is its tokens/s over the time
it spent decoding them (as SGLang's, counted over its decode iterations): the speed the online refit fits.

``python -m tests.e2e.sglang_server --model-path M --host H --port P ...`` takes SGLang's launcher flags and ignores
those it has no use for; ``HexSGLangBackend`` runs it in place of SGLang when a rollout worker has
``HEX_SGLANG_SERVER_MODULE=tests.e2e.sglang_server``.

With ``log_path`` (or ``HEX_STANDIN_LOG_DIR`` for the command) the server appends one JSON line when it starts
(the flags it runs with and the devices it was given), per weight load (version, weight digest) and per finished
or aborted ``/generate`` (the weight version it used) and per request on arrival (new, or the rest of one it
aborted), so a test can check what each server ran and how many requests it was sent. After loading a version the
relay staged, it also saves a copy of the weights it then serves beside the log, with the staged buckets' layout
in the load record, so a test can recompute the trainer's digest of that version from them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import struct
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from flask import jsonify, request

from areal_hex_plugin.fast_exit import freeze_heap_at_exit
from areal_hex_plugin.transport.sinks import TensorParallelSink, shard_dim
from tests.transport.sglang_standin import SGLangStandIn

LOG_DIR_ENV = "HEX_STANDIN_LOG_DIR"
# A file holding a whole number N: every generation then ends (as at EOS) after N tokens. Read at each request,
# so a test can change the served lengths mid-run.
LENGTHS_FILE_ENV = "HEX_STANDIN_LENGTHS_FILE"
# A JSON file {"pool": P, "requests": N}, for a test that kills a server while it holds requests open: a server of
# pool P (its HEX_POOL) answers none of its requests and, once N are open, claims "<file>.held" (its PID and log),
# holding them until it is killed. One server claims it per run; one started after the claim (a relaunch) serves.
HOLD_FILE_ENV = "HEX_STANDIN_HOLD_FILE"
# A YAML file of the true catalog the server's decode is paced by (see the module doc).
TRUTH_ENV = "HEX_STANDIN_TRUTH"
REPO = Path(__file__).resolve().parents[2]
# /metrics: gen_throughput counts the tokens decoded over this many seconds.
THROUGHPUT_S = 2.0
# --max-total-tokens by default: the KV pool its token_usage gauge is a fraction of.
KV_POOL_TOKENS = 65_536


def forced_length() -> int | None:
    """The output length ``HEX_STANDIN_LENGTHS_FILE`` sets now (None: unset, or no number there)."""
    path = os.environ.get(LENGTHS_FILE_ENV)
    try:
        return int(Path(path).read_text()) if path else None
    except (OSError, ValueError):
        return None


def true_token_s(path: str | Path, pool: str, tp: int) -> Callable[[int], float]:
    """Seconds per token of a server of ``pool`` at ``tp`` with n requests decoding, on the true catalog at
    ``path``: 1 / the cost model's tokens/s of that shape at n."""
    from areal_hex_plugin.costmodel import CostModel
    from areal_hex_plugin.costmodel.refit import server_tokens_per_s
    from areal_hex_plugin.specs.recipe import load_recipe

    truth = yaml.safe_load(Path(path).read_text())
    figures = [
        f"hex.gpu_catalog.{t}.{k}={v}" for t, spec in truth["gpu_catalog"].items() for k, v in spec.items()
    ]
    recipe = load_recipe(Path(path).parent / truth["recipe"], figures, base_dir=REPO)
    if pool not in {p.name for p in recipe.cluster.pools}:
        raise ValueError(f"{TRUTH_ENV}={path}: no pool {pool!r} in {truth['recipe']} (HEX_POOL names it)")
    cm = CostModel(recipe.cluster, recipe.workload, recipe.calibration)
    return cache(lambda n: 1.0 / server_tokens_per_s(cm, (pool, tp, 1), max(1, n)))


def weights_digest(named_tensors) -> str:
    """SHA-256 over every tensor's name, shape and bf16 bytes, in name order (the dtype the rollout serves)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        flat = tensor.detach().to(torch.bfloat16).contiguous().reshape(-1).view(torch.uint8)
        digest.update(f"{name}:{list(tensor.shape)};".encode())
        digest.update(flat.numpy().tobytes())
    return digest.hexdigest()


def gathered(sink: TensorParallelSink) -> dict[str, torch.Tensor]:
    """The whole tensors behind a sink's TP shards (each sharded tensor's pieces joined on its split dim)."""
    out = {}
    for name, first in sink.shards[0].items():
        dim = shard_dim(name)
        out[name] = first if dim is None else torch.cat([shard[name] for shard in sink.shards], dim)
    return out


def staged_buckets(directory: Path) -> list[tuple[int, list[str]]]:
    """The relay's buckets in a version directory it staged (``bucket-<index>-<copy>.safetensors``, one file per
    bucket): each bucket's index and its tensor names in the order the sender packed them; [] for a plain
    checkpoint."""
    out = []
    for path in sorted(directory.glob("bucket-*.safetensors")):
        with open(path, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        header.pop("__metadata__", None)
        out.append((int(path.name.split("-")[1]), sorted(header, key=lambda n: header[n]["data_offsets"][0])))
    return out


class RequestHold:
    """Holds a server's requests open as ``HEX_STANDIN_HOLD_FILE`` asks; a no-op for every other server."""

    def __init__(self, order_path: str | None, pool: str, log_path: str | None) -> None:
        self.marker: Path | None = None
        self.wanted = 0
        if order_path:
            order = json.loads(Path(order_path).read_text())
            marker = Path(f"{order_path}.held")
            if order["pool"] == pool and not marker.exists():
                self.marker, self.wanted = marker, int(order["requests"])
        self.log_path = log_path
        self.held = 0
        self._lock = threading.Lock()
        self._serving = threading.Event()  # set: this server answers its requests
        if self.marker is None:
            self._serving.set()

    def wait(self) -> None:
        """Returns at once on a serving server; on a holding one, never (until another server claimed first)."""
        if self._serving.is_set():
            return
        with self._lock:
            self.held += 1
            if self.held == self.wanted and not self._claim():
                self._serving.set()
        self._serving.wait()

    def _claim(self) -> bool:
        """Writes the marker whole in one step (a link to a finished file): whether this server was first."""
        draft = self.marker.with_name(f"{self.marker.name}.{os.getpid()}")
        draft.write_text(json.dumps({"pid": os.getpid(), "log": self.log_path, "requests": self.held}))
        try:
            os.link(draft, self.marker)
            return True
        except FileExistsError:
            return False
        finally:
            draft.unlink()


class _Aborted(Exception):
    pass


class _TensorParallel(torch.nn.Module):
    """An HF linear or embedding that computes from the TP shards of the weights last loaded into ``sink``."""

    def __init__(self, sink: TensorParallelSink, name: str, embedding: bool) -> None:
        super().__init__()
        self.sink, self.name, self.embedding = sink, name, embedding
        self.split = shard_dim(f"{name}.weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shards = self.sink.shards
        weights = [shard[f"{self.name}.weight"] for shard in shards]
        biases = [shard.get(f"{self.name}.bias") for shard in shards]
        if self.embedding:  # vocabulary-parallel: each rank looks up its own rows, the rest are zero
            out, start = 0, 0
            for weight in weights:
                local = x - start
                hit = (local >= 0) & (local < weight.shape[0])
                out = out + F.embedding(local.clamp(0, weight.shape[0] - 1), weight) * hit.unsqueeze(-1)
                start += weight.shape[0]
            return out
        if self.split == 0:  # column-parallel: each rank's slice of the output, gathered
            return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)], dim=-1)
        parts = x.chunk(
            len(weights), dim=-1
        )  # row-parallel: partial sums over each rank's inputs, all-reduced
        out = sum(F.linear(part, w) for part, w in zip(parts, weights, strict=True))
        return out if biases[0] is None else out + biases[0]


class SGLangCPUServer(SGLangStandIn):
    """The transport tests' stand-in plus a transformers model on CPU that generates with the weights it was
    last given, held and computed as ``tp_size`` TP shards. ``/update_weights_from_disk`` loads into them."""

    def __init__(
        self,
        model_path: str,
        host: str = "127.0.0.1",
        port: int = 0,
        log_path: str | None = None,
        seed: int = 1,
        tp_size: int = 1,
        max_running_requests: int | None = None,
        max_total_tokens: int = KV_POOL_TOKENS,
        flags: dict | None = None,
        hold: RequestHold | None = None,
        token_s: Callable[[int], float] | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self._lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
        self._eos = self._lm.config.eos_token_id
        self._rng = torch.Generator().manual_seed(seed)
        self._log_path = log_path
        self._hold = hold or RequestHold(None, "", log_path)
        self._lock = threading.Lock()  # one forward step or one weight load at a time
        self._running = threading.Event()  # cleared while paused
        self._running.set()
        self._epoch = 0  # bumped by pause, abort and load: requests started before it end with "abort"
        self._slots = threading.BoundedSemaphore(max_running_requests) if max_running_requests else None
        self._decoding = 0  # requests decoding now
        self._kv_tokens = 0  # tokens whose keys and values the decoding requests hold
        self._kv_pool = max_total_tokens
        self._token_s = token_s  # the true seconds per token at n decoding (true_token_s); None: unpaced
        self._due = 0.0  # when the last token ends on the true model's clock (_pace)
        # When each token of the last THROUGHPUT_S seconds was made, the seconds spent making it, and the requests
        # decoding and the KV tokens they held then.
        self._token_times: deque[tuple[float, float, int, int]] = deque()
        # Prompt + output of every aborted request: upstream resubmits exactly that to finish it.
        self._resumable: Counter[tuple[int, ...]] = Counter()
        self.flags = {
            "tp_size": tp_size,
            "max_running_requests": max_running_requests,
            "max_total_num_tokens": max_total_tokens,
            **(flags or {}),
        }
        super().__init__(tp_size=tp_size, host=host, port=port, start=False)
        self._names = set(self._lm.state_dict())
        self.model.load(0, self._lm.state_dict().items())
        for name, module in list(self._lm.named_modules()):
            if (
                isinstance(module, torch.nn.Linear | torch.nn.Embedding)
                and shard_dim(f"{name}.weight") is not None
            ):
                parent, _, attr = name.rpartition(".")
                sharded = _TensorParallel(self.model, name, isinstance(module, torch.nn.Embedding))
                setattr(self._lm.get_submodule(parent) if parent else self._lm, attr, sharded)
        self._log(event="start", **self.flags)
        self._log(event="load", version="default", digest=self.digest())
        # Before any request is answered (the launcher polls /health as soon as the port listens): SGLang's
        # generation endpoints, and the control endpoints that must also stop running requests.
        self.app.view_functions.update(
            pause=self._pause, disk=self._update_from_disk, weights=self._weights_by_name
        )
        self.app.view_functions["continue"] = self._continue
        for rule, name, view, method in (
            ("/health_generate", "health_generate", lambda: jsonify({}), "GET"),
            ("/get_weight_version", "weight_version", self._get_weight_version, "GET"),
            ("/get_model_info", "model_info", self._get_model_info, "GET"),
            ("/get_server_info", "server_info", lambda: jsonify(self.flags), "GET"),
            ("/metrics", "metrics", self._metrics, "GET"),
            ("/generate", "generate", self._generate, "POST"),
            ("/abort_request", "abort", self._abort, "POST"),
        ):
            self.app.add_url_rule(rule, name, view, methods=[method])
        self.start()

    # -- state --------------------------------------------------------------------------------------------

    def digest(self) -> str:
        return weights_digest(gathered(self.model).items())

    def _log(self, **record) -> None:
        if self._log_path:
            with open(self._log_path, "a") as handle:
                handle.write(json.dumps({**record, "t": time.time()}) + "\n")

    def _interrupt(self) -> None:
        with self._lock:
            self._epoch += 1

    def _metrics(self):
        """SGLang's Prometheus gauges (``--enable-metrics``): the decode tokens/s of the last ``THROUGHPUT_S``
        seconds over the time spent decoding them, and over that time the requests running and the KV pool's used
        fraction (the tokens the running requests hold over ``--max-total-tokens``: the stand-in keeps a cache per
        request, no shared pool), as means. SGLang logs all three for the same decode iterations, over which its
        batch barely moves; the CI's outputs of a few tokens move it every 0.1 s, and the count at the moment of
        reading paired the speed of 5 requests with 7."""
        with self._lock:
            now = time.monotonic()
            while self._token_times and self._token_times[0][0] < now - THROUGHPUT_S:
                self._token_times.popleft()
            busy = sum(seconds for _, seconds, _, _ in self._token_times)
            if busy > 0:
                rate = len(self._token_times) / busy
                running = sum(s * n for _, s, n, _ in self._token_times) / busy
                held = sum(s * kv for _, s, _, kv in self._token_times) / busy
            else:
                rate, running, held = 0.0, self._decoding, self._kv_tokens
            usage = held / self._kv_pool
        labels = '{model_name="stand-in",tp_rank="0"}'
        gauges = {"num_running_reqs": running, "gen_throughput": rate, "token_usage": usage}
        return "".join(f"sglang:{name}{labels} {value}\n" for name, value in gauges.items())

    # -- control endpoints --------------------------------------------------------------------------------

    def _get_weight_version(self):
        return jsonify({"weight_version": self.weight_version})

    def _get_model_info(self):
        return jsonify({"is_generation": True, "weight_version": self.weight_version})

    def _pause(self):
        # SGLang's default pause mode ("abort"): running requests return at once; new ones wait for continue.
        self._running.clear()
        self._interrupt()
        self.events.append("pause")
        return jsonify({"success": True})

    def _continue(self):
        self._running.set()
        self.events.append("continue")
        return jsonify({"success": True})

    def _abort(self):
        self._interrupt()
        return jsonify({"success": True})

    def _load(self, path: Path, fail_half_way: bool = False) -> None:
        """Into the TP shards, whole (the base's load-failure and roll-back handling stays): aborts running
        requests."""
        from safetensors.torch import load_file

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        tensors = {}
        for file in files:
            tensors.update(load_file(str(file)))
        if set(tensors) != self._names:
            missing, unexpected = sorted(self._names - set(tensors)), sorted(set(tensors) - self._names)
            raise RuntimeError(f"missing {missing}, unexpected {unexpected}")
        with self._lock:
            self._epoch += 1  # abort_all_requests
            self.model.load(0, iter(tensors.items()))
            # The replicated tensors (norms) stay the HF model's own parameters.
            self._lm.load_state_dict({n: t for n, t in self.model.shards[0].items() if shard_dim(n) is None})

    def _update_from_disk(self):
        answer = super()._update_from_disk()
        if not isinstance(answer, tuple):  # loaded (a failure answers with its status code)
            buckets = staged_buckets(self.path)
            if (
                self._log_path and buckets
            ):  # a copy of what it now serves, to check against the relay's digest
                from safetensors.torch import save_file

                save_file(gathered(self.model), self.snapshot_path(self.weight_version))
            self._log(event="load", version=self.weight_version, digest=self.digest(), buckets=buckets)
        return answer

    def snapshot_path(self, version: str) -> str:
        return str(Path(self._log_path).with_suffix(f".v{version}.safetensors"))

    def _weights_by_name(self):
        body = request.get_json()
        tensor = gathered(self.model)[body["name"]]
        return jsonify(tensor.flatten()[: body.get("truncate_size", 100)].float().tolist())

    # -- generation ---------------------------------------------------------------------------------------

    def _generate(self):
        body = request.get_json()
        params = body.get("sampling_params") or {}
        key = tuple(body["input_ids"])
        with self._lock:
            resumed = self._resumable[key] > 0
            self._resumable[key] -= resumed
        # On arrival: a new request, or the rest of an aborted one (its temperature tells evaluation's apart).
        self._log(event="request", resumed=resumed, temperature=params.get("temperature"))
        self._hold.wait()
        with self._slots or contextlib.nullcontext():  # SGLang's max_running_requests: the rest wait
            tokens, logprobs, finish, version = self._run(body["input_ids"], params)
        if finish["type"] == "abort":
            with self._lock:
                self._resumable[key + tuple(tokens)] += 1
        self._log(event="generate", version=version, tokens=len(tokens), finish=finish["type"])
        return jsonify(
            {
                "text": "",
                "output_ids": tokens,
                "meta_info": {
                    "id": body.get("rid") or uuid.uuid4().hex,
                    "finish_reason": finish,
                    "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": len(tokens),
                    "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, tokens, strict=True)],
                    "weight_version": version,
                },
            }
        )

    def _run(self, input_ids, params):
        """Decode once not paused; an abort returns what was made so far."""
        while True:  # wait out a pause; a pause that lands after this check aborts the first step
            self._running.wait()
            with self._lock:
                if self._running.is_set():
                    epoch, version = self._epoch, self.weight_version
                    break
        tokens, logprobs, finish = [], [], {"type": "length", "length": params.get("max_new_tokens", 16)}
        with self._lock:
            self._decoding += 1
            self._kv_tokens += len(input_ids)
        try:
            tokens, logprobs, finish = self._decode(input_ids, params, epoch, tokens, logprobs, finish)
        except _Aborted:
            finish = {"type": "abort", "message": "Abort in waiting queue" if not tokens else "aborted"}
        finally:
            with self._lock:
                self._decoding -= 1
                self._kv_tokens -= len(input_ids) + len(tokens)
        return tokens, logprobs, finish, version

    def _decode(self, input_ids, params, epoch, tokens, logprobs, finish):
        """Sample up to ``max_new_tokens``, one forward step at a time under the lock, with one weight version."""
        temperature = float(params.get("temperature", 1.0))
        top_k, top_p = int(params.get("top_k", -1) or -1), float(params.get("top_p", 1.0) or 1.0)
        stops = set(params.get("stop_token_ids") or [])
        if not params.get("ignore_eos"):
            stops.add(self._eos)
        kv, step_ids = None, torch.tensor([input_ids])
        forced = forced_length()
        for _ in range(int(params.get("max_new_tokens", 16))):
            with self._lock, torch.no_grad():
                if self._epoch != epoch:
                    raise _Aborted
                started = time.monotonic()
                out = self._lm(input_ids=step_ids, past_key_values=kv, use_cache=True)
                if self._token_s is not None:
                    self._pace(started, self._token_s(self._decoding))
                now = time.monotonic()
                self._token_times.append((now, now - started, self._decoding, self._kv_tokens))
            kv, logits = out.past_key_values, out.logits[0, -1].float()
            token, logprob = self._sample(logits, temperature, top_k, top_p)
            with self._lock:
                tokens.append(token)
                self._kv_tokens += 1
            logprobs.append(logprob)
            if token in stops or len(tokens) == forced:
                return tokens, logprobs, {"type": "stop", "matched": token}
            step_ids = torch.tensor([[token]])
        return tokens, logprobs, finish

    def _pace(self, started: float, seconds: float) -> None:
        """Sleep until this token's end on the true model's clock: ``seconds`` after the last token's end there
        while tokens follow back to back (so a late wake-up is made up by the next token), else after
        ``started``."""
        self._due = (self._due if started - self._due < seconds else started) + seconds
        time.sleep(max(0.0, self._due - time.monotonic()))

    def _sample(
        self, logits: torch.Tensor, temperature: float, top_k: int, top_p: float
    ) -> tuple[int, float]:
        """A token from the temperature-scaled distribution, cut to top-k / top-p; its log-prob under it."""
        if temperature <= 0:
            token = int(logits.argmax())
            return token, float(torch.log_softmax(logits, -1)[token])
        logp = torch.log_softmax(logits / temperature, -1)
        probs = logp.exp()
        if 0 < top_k < probs.numel():
            probs[probs < probs.topk(top_k).values[-1]] = 0
        if top_p < 1.0:
            ordered, order = probs.sort(descending=True)
            drop = ordered.cumsum(0) - ordered > top_p * ordered.sum()
            probs[order[drop]] = 0
        token = int(torch.multinomial(probs, 1, generator=self._rng))
        return token, float(logp[token])

    def serve_forever(self) -> None:
        self._thread.join()


def main(argv: list[str] | None = None) -> None:
    """SGLang's launcher command line: ``--model-path --host --port --random-seed --tp-size
    --max-running-requests`` are used, ``--pp-size --mem-fraction-static --attention-backend`` reported, the rest
    ignored."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--random-seed", type=int, default=1)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--pp-size", type=int, default=1)
    parser.add_argument("--max-running-requests", type=int, default=None)
    parser.add_argument("--max-total-tokens", type=int, default=KV_POOL_TOKENS)
    parser.add_argument("--mem-fraction-static", type=float, default=None)
    parser.add_argument("--attention-backend", default=None)
    args, _ = parser.parse_known_args(argv)
    if args.pp_size != 1:
        parser.error(f"--pp-size {args.pp_size}: the stand-in runs tensor parallelism only")
    log_dir = os.environ.get(LOG_DIR_ENV)
    pool = os.environ.get("HEX_POOL", "server")
    log_path = None
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        log_path = str(Path(log_dir) / f"{pool}-{args.port}.jsonl")
    flags = {
        "pp_size": args.pp_size,
        "mem_fraction_static": args.mem_fraction_static,
        "attention_backend": args.attention_backend,
        # The devices its worker was given: by the scheduler, and by the plan.
        "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "planned_gpu_ids": os.environ.get("HEX_GPU_IDS"),
        "truth": os.environ.get(TRUTH_ENV),
    }
    truth = flags["truth"]
    server = SGLangCPUServer(
        args.model_path,
        args.host,
        args.port,
        log_path,
        args.random_seed,
        tp_size=args.tp_size,
        max_running_requests=args.max_running_requests,
        max_total_tokens=args.max_total_tokens,
        flags=flags,
        hold=RequestHold(os.environ.get(HOLD_FILE_ENV), pool, log_path),
        token_s=true_token_s(truth, pool, args.tp_size) if truth else None,
    )
    signal.signal(signal.SIGTERM, lambda *_: server.close())
    freeze_heap_at_exit()  # its worker stops it, then waits on its exit (fast_exit.py)
    server.serve_forever()


if __name__ == "__main__":
    main()
