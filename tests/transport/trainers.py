"""A trainer in a process of its own (a real RelaySender), for tests that stop, flood or restart it."""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import signal
from typing import Any

import torch

from areal_hex_plugin.transport.route import Endpoint, PoolRoute, Route
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
from tests.transport.harness import TOKEN

_CTX = mp.get_context("fork")


def state_of(version: int) -> dict[str, torch.Tensor]:
    """A small model whose every value is ``version``."""
    return {"model.layers.0.mlp.up_proj.weight": torch.full((64, 32), float(version))}


def _trainer_main(endpoints: list[Endpoint], config: dict[str, Any], fd_headroom: int | None, asks, answers):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sender = RelaySender(Route([PoolRoute("h20", endpoints, 1.5, 5.0)]), SenderConfig(**config), token=TOKEN)
    while (version := asks.get()) is not None:
        report = sender.send_version(version, [list(state_of(version).items())])
        if fd_headroom is not None and version == 1:
            used = len(os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (used + fd_headroom, used + fd_headroom))
        answers.put(report.committed)
    sender.close()


class TrainerProcess:
    """Sends version v to ``endpoints`` (one pool) for each :meth:`send`; with ``fd_headroom``, its descriptors are
    capped that far above their use once the first version committed."""

    def __init__(self, endpoints: list[Endpoint], fd_headroom: int | None = None, **config: Any) -> None:
        self._asks, self._answers = _CTX.Queue(), _CTX.Queue()
        self.process = _CTX.Process(
            target=_trainer_main, args=(endpoints, config, fd_headroom, self._asks, self._answers)
        )
        self.process.start()

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def send(self, version: int, timeout_s: float = 60.0) -> list[str]:
        """The replicas that committed ``version``."""
        self.ask(version)
        return self._answers.get(timeout=timeout_s)

    def ask(self, version: int) -> None:
        """Start sending ``version`` (without waiting for its report)."""
        self._asks.put(version)

    def __enter__(self) -> TrainerProcess:
        return self

    def __exit__(self, *exc) -> None:
        if self.process.is_alive():
            os.kill(self.pid, signal.SIGCONT)  # a stopped one ignores everything else
            self.process.kill()
        self.process.join(timeout=10)
