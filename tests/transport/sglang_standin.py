"""A stand-in for an SGLang server (SGLang cannot run on CPU): it speaks the documented HTTP endpoints the
transport uses and loads ``/update_weights_from_disk`` checkpoints into TP shards the way SGLang's loader slices.

Like SGLang's ``ModelRunner.update_weights_from_disk``, it reads every ``*.safetensors`` file of the directory and,
when a load fails half-way, reloads the weights from the path it loaded last (so that path must still exist).
``fail_loads`` makes loads fail half-way; ``stale`` makes loads report success without loading.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from flask import Flask, jsonify, request
from werkzeug.serving import make_server

from areal_hex_plugin.transport.sinks import TensorParallelSink, shard_dim


class SGLangStandIn:
    def __init__(self, tp_size: int, host: str = "127.0.0.1", port: int = 0, start: bool = True) -> None:
        self.events: list[str] = []
        self.model = TensorParallelSink(tp_size)
        self.path: Path | None = None
        self.weight_version = "default"  # SGLang's label of the loaded weights (update_weights_from_disk)
        self.fail_loads = False
        self.stale = False
        app = Flask("sglang-stand-in")
        app.add_url_rule("/health", "health", lambda: jsonify({}), methods=["GET"])
        app.add_url_rule("/pause_generation", "pause", self._event("pause"), methods=["POST"])
        app.add_url_rule("/continue_generation", "continue", self._event("continue"), methods=["POST"])
        app.add_url_rule("/update_weights_from_disk", "disk", self._update_from_disk, methods=["POST"])
        app.add_url_rule("/get_weights_by_name", "weights", self._weights_by_name, methods=["POST"])
        self.app = app  # tests/e2e/sglang_server.py adds generation to it, then calls start()
        # Listening from here on: a client that connects before start() waits for it.
        self._server = make_server(host, port, app, threaded=True)
        self.address = f"{host}:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        """Answer requests (Flask refuses new routes after the first one)."""
        self._thread.start()

    def _event(self, name: str):
        def handler():
            self.events.append(name)
            return jsonify({"success": True})

        return handler

    def _load(self, path: Path, fail_half_way: bool = False) -> None:
        from safetensors.torch import load_file

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        tensors = {}
        for index, file in enumerate(files):
            if fail_half_way and index == len(files) // 2:
                self.model.load(0, iter(tensors.items()))  # half of the new weights are in the model now
                raise RuntimeError("CUDA out of memory (injected)")
            tensors.update(load_file(str(file)))
        self.model.load(0, iter(tensors.items()))

    def _update_from_disk(self):
        body = request.get_json()
        path = Path(body["model_path"])
        self.events.append(f"load {path.name}")
        if self.stale:
            return jsonify({"success": True, "message": "loaded"})
        try:
            self._load(path, fail_half_way=self.fail_loads)
        except Exception as error:  # noqa: BLE001 - SGLang answers every load failure the same way
            if self.path is not None:
                self._load(self.path)  # SGLang's roll-back: the weights it loaded last, from their path
            message = f"Failed to update weights: {error}. Rolling back to original weights."
            return jsonify({"success": False, "message": message}), 400
        self.path = path
        self.weight_version = body.get("weight_version") or self.weight_version
        return jsonify({"success": True, "message": "loaded"})

    def _weights_by_name(self):
        body = request.get_json()
        tensor = self.model.shards[0][body["name"]]
        return jsonify(tensor.flatten()[: body.get("truncate_size", 100)].float().tolist())

    def holds(self, state: dict[str, torch.Tensor]) -> bool:
        """Whether the TP shards put back together are exactly ``state``."""
        for name, full in state.items():
            dim = shard_dim(name)
            shards = [self.model.shards[rank][name] for rank in range(self.model.tp_size)]
            if not torch.equal(torch.cat(shards, dim) if dim is not None else shards[0], full):
                return False
        return True

    def close(self) -> None:
        self._server.shutdown()
