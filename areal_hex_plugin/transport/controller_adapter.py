"""Controller side: one weight update as pause, send, verify, commit, resume.

Upstream's trainer already pauses rollout dispatch before ``actor.update_weights(meta.with_version(v))`` and
resumes it after ``set_version(v)``; upstream's FSDP update also pauses generation on the servers while the
buckets stream. Inside that window this controller runs the two phases: the train workers stream and verify
(replicas stage, still holding the old version), then every verified replica commits (its server pauses, loads,
takes the version label, resumes). So the label upstream sets right after is true for every replica that
committed, and a failed update leaves every replica on its old version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from areal.infra.utils.concurrent import run_async_task
from areal.trainer.ppo.actor import PPOActorController
from areal.utils import logging

from areal_hex_plugin.transport.route import Endpoint, PoolRoute, Route
from areal_hex_plugin.transport.wire import TransportError

logger = logging.getLogger("HexPPOActorController")


@dataclass
class TransportPool:
    """Which rollout workers (indices into the rollout controller's ``workers``) form one pool, and its links."""

    name: str
    workers: list[int]
    cross_gb_per_s: float
    intra_gb_per_s: float


@dataclass
class TransportSettings:
    pools: list[TransportPool] = field(default_factory=list)
    # SenderConfig fields: backend (tcp|gloo|nccl), timeout_s, chunk_bytes, on_failure (reroute|fail), max_resends.
    sender: dict[str, Any] = field(default_factory=dict)
    # hex_start_receiver keyword arguments: bind_host or bind_interface, port, timeout_s, allowed_hosts, stage_dir,
    # model_path.
    receiver: dict[str, Any] = field(default_factory=dict)
    # Raise when fewer replicas than this fraction committed (the rest keep serving their old version).
    min_committed_fraction: float = 1.0


class HexPPOActorController(PPOActorController):
    hex_settings: TransportSettings | None = None
    hex_last_report: dict[str, Any] | None = None
    hex_ranks: dict[str, int] = {}  # each receiver of the route (endpoint text) -> its rollout rank
    # Set by the elastic watcher (areal/elastic/): of the rollout ranks a version failed to commit on, how many
    # are lost servers. Those leave the version's commit set instead of failing it.
    hex_lost_among: Callable[[list[int]], int] | None = None

    def configure_hex_transport(self, settings: TransportSettings) -> None:
        """Set the pools (from the plan) before the first update; the receivers start on first use."""
        self.hex_settings = settings
        self._hex_route: Route | None = None

    def update_weights(self, meta) -> None:
        self._check_rollout_engine_connected()
        if self.hex_settings is None:
            raise RuntimeError(
                "hex transport: call configure_hex_transport(settings) before the first update"
            )
        if getattr(self, "_hex_route", None) is None:
            self._hex_route = start_receivers(self.rollout, self.hex_settings, trainer_hosts(self))
            pairs = zip(self.hex_settings.pools, self._hex_route.pools, strict=False)
            self.hex_ranks = {
                str(e): rank
                for pool, sent in pairs
                for rank, e in zip(pool.workers, sent.replicas, strict=True)
            }
            self._custom_function_call(
                "hex_configure_transport", self._hex_route.to_dict(), self.hex_settings.sender
            )
        try:
            self._custom_function_call("update_weights", meta=meta)  # send + verify: replicas stage
        except Exception:
            self._custom_function_call("hex_abort")
            raise
        self._check(self._custom_function_call("hex_commit"))  # every verified replica switches over

    def _check(self, report: dict[str, Any] | None) -> None:
        if report is not None:
            self.hex_last_report = report
        replicas = self._hex_route.replica_count
        if report is not None and report["failed"] and self.hex_lost_among is not None:
            ranks = getattr(self, "hex_ranks", {})
            lost = self.hex_lost_among([ranks[e] for e in report["failed"] if e in ranks])
            if lost:
                logger.warning(
                    f"weights v{report['version']}: {lost} of the replicas that failed it are lost rollout "
                    "servers; they leave its commit set"
                )
            replicas -= lost
        check_report(report, replicas, self.hex_settings.min_committed_fraction)

    def stop_receivers(self) -> None:
        """Stop every replica's receiver and remove its staged weights (teardown, before the rollout goes)."""
        if getattr(self, "_hex_route", None) is not None:
            call_receivers(self.rollout, "hex_stop_receiver")
            self._hex_route = None


def check_report(report: dict[str, Any] | None, replicas: int, min_committed_fraction: float) -> None:
    """Log a committed version's report; refuse it when fewer than ``min_committed_fraction`` of the route's
    ``replicas`` committed (the rest keep serving their old version)."""
    if report is None:
        raise TransportError("hex transport: the train workers sent nothing")
    committed = len(report["committed"])
    logger.info(
        f"weights v{report['version']}: {report['bytes'] / 1e9:.2f} GB to {committed}/{replicas} replicas in "
        f"{report['seconds']:.2f} s (re-sent {report['resent_buckets']}, re-routed {report['reroutes']}; "
        f"{len(report['part_bytes'])} parts, digest {report['digest']}, update {report['update']})"
    )
    if committed < min_committed_fraction * replicas:
        raise TransportError(
            f"hex transport: only {committed} of {replicas} replicas committed version {report['version']}; "
            f"failed: {report['failed']}"
        )


def call_receivers(rollout, method: str, **kwargs: Any) -> list[Any]:
    """Call ``method`` on every engine of a rollout controller through upstream's generic engine RPC, in rank
    order."""

    async def call_all() -> list[Any]:
        return await asyncio.gather(
            *[
                rollout.scheduler.async_call_engine(
                    worker.id, method, engine_name=rollout._engine_name(rank), **kwargs
                )
                for rank, worker in enumerate(rollout.workers)
            ]
        )

    return run_async_task(call_all)


def trainer_hosts(train_controller) -> list[str]:
    """Where the trainer's control channels come from: the host of the train worker of rank 0 (the sender)."""
    workers = getattr(train_controller, "workers", None) or []
    return [workers[0].ip] if workers else []


def receiver_options(settings: TransportSettings, trainers: list[str] | None = None) -> dict:
    """``hex_start_receiver``'s arguments: the settings' receiver options, taking control only from ``trainers``
    (hosts; None or empty: the rollout machine's own)."""
    return {**settings.receiver, **({"trainer_hosts": trainers} if trainers else {})}


def start_receivers(rollout, settings: TransportSettings, trainers: list[str] | None = None) -> Route:
    """Start every rollout engine's receiver (see :func:`receiver_options`); the route through them, pool by
    pool."""
    options = receiver_options(settings, trainers)
    endpoints = [Endpoint.parse(text) for text in call_receivers(rollout, "hex_start_receiver", **options)]
    pools = settings.pools or [TransportPool("rollout", list(range(len(endpoints))), 1.5, 5.0)]
    return Route(
        [
            PoolRoute(
                pool.name, [endpoints[i] for i in pool.workers], pool.cross_gb_per_s, pool.intra_gb_per_s
            )
            for pool in pools
        ]
    )
