"""A stand-in for an SGLang server (SGLang cannot run on CPU): it speaks the documented HTTP endpoints the
transport uses and loads ``/update_weights_from_disk`` checkpoints into TP shards the way SGLang's loader slices."""

from __future__ import annotations

import threading

from flask import Flask, jsonify, request
from werkzeug.serving import make_server

from areal_hex_plugin.transport.sinks import TensorParallelSink


class SGLangStandIn:
    def __init__(self, tp_size: int) -> None:
        self.events: list[str] = []
        self.model = TensorParallelSink(tp_size)
        app = Flask("sglang-stand-in")
        app.add_url_rule("/health", "health", lambda: jsonify({}), methods=["GET"])
        app.add_url_rule("/pause_generation", "pause", self._event("pause"), methods=["POST"])
        app.add_url_rule("/continue_generation", "continue", self._event("continue"), methods=["POST"])
        app.add_url_rule("/update_weights_from_disk", "disk", self._update_from_disk, methods=["POST"])
        self._server = make_server("127.0.0.1", 0, app, threaded=True)
        self.address = f"127.0.0.1:{self._server.server_port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _event(self, name: str):
        def handler():
            self.events.append(name)
            return jsonify({"success": True})

        return handler

    def _update_from_disk(self):
        from pathlib import Path

        from safetensors.torch import load_file

        path = Path(request.get_json()["model_path"]) / "model.safetensors"
        self.events.append(f"load {path.parent.name}")
        self.model.load(0, iter(load_file(str(path)).items()))
        return jsonify({"success": True, "message": "loaded"})

    def close(self) -> None:
        self._server.shutdown()
