"""The rollout server of the CPU end-to-end runs, the one stand-in in the loop (SGLang cannot run on CPU): the
transport tests' SGLang stand-in (``tests/transport/sglang_standin.py``) plus a transformers model on CPU that
``/generate``s token by token (sampling parameters, per-token log-probs) with the weights it was last given, and
answers pause, continue, abort, health and weight-version calls as SGLang does, as upstream's
``SGLangBackend``/``RemoteSGLangEngine`` and the relay transport's sink call them.

``python -m tests.e2e.sglang_server --model-path M --host H --port P ...`` takes SGLang's launcher flags and ignores
those it has no use for; ``HexSGLangBackend`` runs it in place of SGLang when a rollout worker has
``HEX_SGLANG_SERVER_MODULE=tests.e2e.sglang_server``.

With ``log_path`` (or ``HEX_STANDIN_LOG_DIR`` for the command) the server appends one JSON line per weight load
(version, weight digest) and per finished or aborted ``/generate`` (the weight version it used), so a test can
check what each server ran.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import torch
from flask import jsonify, request

from tests.transport.sglang_standin import SGLangStandIn

LOG_DIR_ENV = "HEX_STANDIN_LOG_DIR"


def weights_digest(named_tensors) -> str:
    """SHA-256 over every tensor's name, shape and bf16 bytes, in name order (the dtype the rollout serves)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        flat = tensor.detach().to(torch.bfloat16).contiguous().reshape(-1).view(torch.uint8)
        digest.update(f"{name}:{list(tensor.shape)};".encode())
        digest.update(flat.numpy().tobytes())
    return digest.hexdigest()


class _Aborted(Exception):
    pass


class SGLangCPUServer(SGLangStandIn):
    """The transport tests' stand-in plus a transformers model on CPU that generates with the weights it was
    last given. ``/update_weights_from_disk`` loads into that model instead of the TP shards."""

    def __init__(
        self,
        model_path: str,
        host: str = "127.0.0.1",
        port: int = 0,
        log_path: str | None = None,
        seed: int = 1,
    ) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self._lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
        self._eos = self._lm.config.eos_token_id
        self._rng = torch.Generator().manual_seed(seed)
        self._log_path = log_path
        self._lock = threading.Lock()  # one forward step or one weight load at a time
        self._running = threading.Event()  # cleared while paused
        self._running.set()
        self._epoch = 0  # bumped by pause, abort and load: requests started before it end with "abort"
        self._log(event="load", version="default", digest=self.digest())
        super().__init__(tp_size=1, host=host, port=port)
        # Before any request can arrive (nobody knows the port yet): SGLang's generation endpoints, and the
        # control endpoints that must also stop running requests.
        self.app.view_functions.update(
            pause=self._pause, disk=self._update_from_disk, weights=self._weights_by_name
        )
        self.app.view_functions["continue"] = self._continue
        for rule, name, view, method in (
            ("/health_generate", "health_generate", lambda: jsonify({}), "GET"),
            ("/get_weight_version", "weight_version", self._get_weight_version, "GET"),
            ("/get_model_info", "model_info", self._get_model_info, "GET"),
            ("/generate", "generate", self._generate, "POST"),
            ("/abort_request", "abort", self._abort, "POST"),
        ):
            self.app.add_url_rule(rule, name, view, methods=[method])

    # -- state --------------------------------------------------------------------------------------------

    def digest(self) -> str:
        return weights_digest(self._lm.state_dict().items())

    def _log(self, **record) -> None:
        if self._log_path:
            with open(self._log_path, "a") as handle:
                handle.write(json.dumps({**record, "t": time.time()}) + "\n")

    def _interrupt(self) -> None:
        with self._lock:
            self._epoch += 1

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
        """Into the model (the base's load-failure and roll-back handling stays): aborts running requests."""
        from safetensors.torch import load_file

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        tensors = {}
        for file in files:
            tensors.update(load_file(str(file)))
        with self._lock:
            self._epoch += 1  # abort_all_requests
            missing, unexpected = self._lm.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise RuntimeError(f"missing {missing}, unexpected {unexpected}")

    def _update_from_disk(self):
        answer = super()._update_from_disk()
        if not isinstance(answer, tuple):  # loaded (a failure answers with its status code)
            self._log(event="load", version=self.weight_version, digest=self.digest())
        return answer

    def _weights_by_name(self):
        body = request.get_json()
        tensor = self._lm.state_dict()[body["name"]]
        return jsonify(tensor.flatten()[: body.get("truncate_size", 100)].float().tolist())

    # -- generation ---------------------------------------------------------------------------------------

    def _generate(self):
        body = request.get_json()
        params = body.get("sampling_params") or {}
        while True:  # wait out a pause; a pause that lands after this check aborts the first step
            self._running.wait()
            with self._lock:
                if self._running.is_set():
                    epoch, version = self._epoch, self.weight_version
                    break
        tokens, logprobs, finish = [], [], {"type": "length", "length": params.get("max_new_tokens", 16)}
        try:
            tokens, logprobs, finish = self._decode(
                body["input_ids"], params, epoch, tokens, logprobs, finish
            )
        except _Aborted:
            finish = {"type": "abort", "message": "Abort in waiting queue" if not tokens else "aborted"}
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

    def _decode(self, input_ids, params, epoch, tokens, logprobs, finish):
        """Sample up to ``max_new_tokens``, one forward step at a time under the lock, with one weight version."""
        temperature = float(params.get("temperature", 1.0))
        top_k, top_p = int(params.get("top_k", -1) or -1), float(params.get("top_p", 1.0) or 1.0)
        stops = set(params.get("stop_token_ids") or [])
        if not params.get("ignore_eos"):
            stops.add(self._eos)
        cache, step_ids = None, torch.tensor([input_ids])
        for _ in range(int(params.get("max_new_tokens", 16))):
            with self._lock, torch.no_grad():
                if self._epoch != epoch:
                    raise _Aborted
                out = self._lm(input_ids=step_ids, past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[0, -1].float()
            token, logprob = self._sample(logits, temperature, top_k, top_p)
            tokens.append(token)
            logprobs.append(logprob)
            if token in stops:
                return tokens, logprobs, {"type": "stop", "matched": token}
            step_ids = torch.tensor([[token]])
        return tokens, logprobs, finish

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
    """SGLang's launcher command line: ``--model-path --host --port --random-seed`` are used, the rest ignored."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--random-seed", type=int, default=1)
    args, _ = parser.parse_known_args(argv)
    log_dir = os.environ.get(LOG_DIR_ENV)
    log_path = None
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        log_path = str(Path(log_dir) / f"{os.environ.get('HEX_POOL', 'server')}-{args.port}.jsonl")
    server = SGLangCPUServer(args.model_path, args.host, args.port, log_path, args.random_seed)
    signal.signal(signal.SIGTERM, lambda *_: server.close())
    server.serve_forever()


if __name__ == "__main__":
    main()
