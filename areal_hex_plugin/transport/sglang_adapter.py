"""Rollout side inside upstream AReaL: relay receiver methods for a RemoteSGLangEngine subclass.

``RelayReceiverMixin`` goes first in the bases of the plugin's ``HexRemoteSGLangEngine`` (which owns the SGLang
backend and the rollout controller); the controller reaches its ``hex_*`` methods through upstream's generic
``/call`` RPC. A committed version goes into the
local SGLang server through SGLang's own ``/update_weights_from_disk`` from a node-local directory (``/dev/shm``
by default; its size is checked as buckets arrive): SGLang's loaders then slice every full HF tensor to the server's
TP layout, whatever it is, and no shared filesystem or cross-machine NCCL group is needed. Once loaded, a version
moves to ``rollback_dir`` on node-local disk (its staged path becomes a link there), so during a commit the machine
holds the new version in memory and the one a failed load returns to on disk.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from areal.api.io_struct import WeightUpdateMeta
from areal.engine.sglang_remote import RemoteSGLangEngine

from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
from areal_hex_plugin.transport.wire import interface_address

_MODEL_FILES = ("config.json", "generation_config.json")


class SGLangDiskSink:
    """Pause, load the staged version's directory into the server, spot-check it, label it, resume.

    The version is already on disk as safetensors files (``stage.py``); SGLang reads every ``*.safetensors`` of
    the directory. When SGLang's load fails it rolls back by itself to the path it loaded last, which the node
    keeps until this load is confirmed. After a load the server's copy of a few tensors SGLang keeps whole (the
    norm weights) is read back with ``/get_weights_by_name`` and compared with the verified staged bytes; a
    mismatch (a load that did not happen) reloads the last committed version and fails the commit.
    """

    def __init__(self, engine: RemoteSGLangEngine, model_path: str | None) -> None:
        self.engine, self.model_path = engine, model_path
        # What to roll back to: the directory loaded last and its version.
        self._loaded: tuple[str | None, int | None] = (model_path, None)

    def load(self, version: int, staged) -> None:
        directory = Path(staged.directory)
        for name in _MODEL_FILES if self.model_path else ():
            source = Path(self.model_path) / name
            if source.exists():
                _copy_new(source, directory / name)
        self.engine.pause_generation()
        try:
            self._load_directory(directory, version)
            mismatch = self._spot_check(staged)
            if mismatch:
                if self._loaded[0] is not None:
                    self._load_directory(Path(self._loaded[0]), self._loaded[1])
                raise RuntimeError(f"the server does not hold the loaded version ({mismatch}); rolled back")
            self._loaded = (str(directory), version)
            self.engine.set_version(version)
        finally:
            self.engine.continue_generation()

    def _load_directory(self, directory: Path, version: int | None) -> None:
        requests = self.engine._engine.backend.build_disk_weight_update_requests(
            WeightUpdateMeta(type="disk", path=str(directory))
        )
        for request in requests.requests:
            if version is not None:
                # SGLang labels the loaded weights (GET /get_weight_version) with the trainer's version.
                request.payload["weight_version"] = str(version)
            self.engine._engine._run_request_on_all_servers(request)

    def _spot_check(self, staged, count: int = 3, elements: int = 64) -> str:
        """The first mismatching tensor of up to ``count`` norm weights on every server, or ''."""
        import requests as http

        names = [(n, t) for n, t in staged if n.endswith("norm.weight")][:count]
        for address in self.engine._engine.addresses:
            for name, tensor in names:
                answer = http.post(
                    f"http://{address}/get_weights_by_name",
                    json={"name": name, "truncate_size": elements},
                    timeout=60,
                )
                answer.raise_for_status()
                expected = tensor.flatten()[:elements].float().tolist()
                if answer.json() != expected:
                    return f"{name} on {address}"
        return ""


def _copy_new(source: Path, target: Path) -> None:
    """Copy ``source`` to a new file ``target``, never through a link or over a file already there."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with open(source, "rb") as reader, open(os.open(target, flags, 0o600), "wb") as writer:
        shutil.copyfileobj(reader, writer)


class RelayReceiverMixin:
    """``hex_*`` receiver methods (start, status, stop) for a ``RemoteSGLangEngine`` subclass."""

    _hex_node: ReceiverNode | None = None

    def hex_start_receiver(
        self,
        bind_host: str | None = None,
        port: int = 0,
        timeout_s: float = 30.0,
        allowed_hosts: list[str] | None = None,
        stage_dir: str = "/dev/shm",
        model_path: str | None = None,
        bind_interface: str | None = None,
        rollback_dir: str | None = "/var/tmp",
        trainer_hosts: list[str] | None = None,
    ) -> str:
        """Start (once) the receiver; returns ``host:port``.

        It listens on ``bind_host``, else on the IPv4 address of ``bind_interface`` (resolved here, on the rollout
        machine), else on this host's own address. Only ``trainer_hosts`` (the controller names the host of the
        train worker that sends, rank 0) may open its control channel; None: this machine alone. ``stage_dir`` and
        ``rollback_dir`` are shared directories: the node works in a private ``areal-hex-uid<uid>`` of its own
        there (``scratch.py``).
        """
        if self._hex_node is None:
            from areal.utils.network import gethostip

            if bind_host is None and bind_interface is not None:
                bind_host = interface_address(bind_interface)
            config = ReceiverConfig(
                bind_host or gethostip(),
                port,
                timeout_s,
                list(allowed_hosts or []),
                stage_dir,
                rollback_dir=rollback_dir,
            )
            if trainer_hosts:
                config.trainer_hosts = list(trainer_hosts)
            self._hex_node = ReceiverNode(SGLangDiskSink(self, model_path), config)
            self._hex_endpoint = str(self._hex_node.start())
        return self._hex_endpoint

    def hex_receiver_status(self) -> dict[str, Any]:
        node = self._hex_node
        return {"version": node.version if node else -1, "digest": node.digest if node else ""}

    def hex_stop_receiver(self) -> None:
        """Stop the receiver, which removes its stage and rollback directories (call on teardown)."""
        if self._hex_node is not None:
            self._hex_node.stop()
            self._hex_node = None
