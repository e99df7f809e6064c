"""Rollout side inside upstream AReaL: relay receiver methods for a RemoteSGLangEngine subclass.

``RelayReceiverMixin`` goes first in the bases of the plugin's ``HexRemoteSGLangEngine`` (which owns the SGLang
backend and the rollout controller); the controller reaches its ``hex_*`` methods through upstream's generic
``/call`` RPC. A committed version goes into the
local SGLang server through SGLang's own ``/update_weights_from_disk`` from a node-local directory (``/dev/shm``
by default): SGLang's loaders then slice every full HF tensor to the server's TP layout, whatever it is, and no
shared filesystem or cross-machine NCCL group is needed.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from areal.api.io_struct import WeightUpdateMeta
from areal.engine.sglang_remote import RemoteSGLangEngine

from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
from areal_hex_plugin.transport.wire import interface_address

_MODEL_FILES = ("config.json", "generation_config.json")


class SGLangDiskSink:
    """Write the verified version, then pause, load it into the server, label it, resume (one atomic step)."""

    def __init__(self, engine: RemoteSGLangEngine, stage_dir: Path, model_path: str | None) -> None:
        self.engine, self.stage_dir, self.model_path = engine, stage_dir, model_path

    def load(self, version: int, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        target = self.stage_dir / f"v{version}"
        shutil.rmtree(target, ignore_errors=True)
        try:
            target.mkdir(parents=True)
            # Clones: the views share their bucket's storage, which safetensors refuses.
            save_file(
                {name: tensor.clone() for name, tensor in named_tensors}, str(target / "model.safetensors")
            )
            for name in _MODEL_FILES if self.model_path else ():
                source = Path(self.model_path) / name
                if source.exists():
                    shutil.copy(source, target / name)
            requests = self.engine._engine.backend.build_disk_weight_update_requests(
                WeightUpdateMeta(type="disk", path=str(target))
            )
            self.engine.pause_generation()
            try:
                for request in requests.requests:
                    self.engine._engine._run_request_on_all_servers(request)
                self.engine.set_version(version)
            finally:
                self.engine.continue_generation()
        finally:
            # A full copy of the model in node memory (/dev/shm): of no use once the server has read it.
            shutil.rmtree(target, ignore_errors=True)


class RelayReceiverMixin:
    """``hex_*`` receiver methods (start, status, stop) for a ``RemoteSGLangEngine`` subclass."""

    _hex_node: ReceiverNode | None = None

    def hex_start_receiver(
        self,
        bind_host: str | None = None,
        port: int = 0,
        timeout_s: float = 30.0,
        allowed_hosts: list[str] | None = None,
        stage_dir: str = "/dev/shm/areal-hex",
        model_path: str | None = None,
        bind_interface: str | None = None,
    ) -> str:
        """Start (once) the receiver; returns ``host:port``.

        It listens on ``bind_host``, else on the IPv4 address of ``bind_interface`` (resolved here, on the rollout
        machine), else on this host's own address.
        """
        if self._hex_node is None:
            from areal.utils.network import gethostip

            if bind_host is None and bind_interface is not None:
                bind_host = interface_address(bind_interface)
            config = ReceiverConfig(bind_host or gethostip(), port, timeout_s, list(allowed_hosts or []))
            self._hex_stage_dir = Path(stage_dir) / f"{config.bind_host}-{id(self):x}"
            self._hex_node = ReceiverNode(SGLangDiskSink(self, self._hex_stage_dir, model_path), config)
            self._hex_endpoint = str(self._hex_node.start())
        return self._hex_endpoint

    def hex_receiver_status(self) -> dict[str, Any]:
        node = self._hex_node
        return {"version": node.version if node else -1, "digest": node.digest if node else ""}

    def hex_stop_receiver(self) -> None:
        """Stop the receiver and remove this engine's stage directory (call on teardown)."""
        if self._hex_node is not None:
            self._hex_node.stop()
            self._hex_node = None
            shutil.rmtree(self._hex_stage_dir, ignore_errors=True)
