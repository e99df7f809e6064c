"""Train side inside upstream AReaL: an FSDP PPO actor whose bucket send goes through the relay transport.

Upstream's ``_update_weights_from_distributed`` still does the work it is good at (all-gather every FSDP
shard into a full HF-named tensor, cast to the compute dtype, cut into ``weight_chunked_mem_mb`` buckets, pause
and resume generation); only group set-up and bucket send are replaced, so rank 0 hands each bucket to a
:class:`RelaySender` instead of broadcasting it over one static NCCL group.
"""

from __future__ import annotations

from typing import Any

from areal.engine.fsdp_engine import FSDPPPOActor

from areal_hex_plugin.transport.route import Route
from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
from areal_hex_plugin.transport.wire import TransportError


class HexFSDPPPOActor(FSDPPPOActor):
    """Keep ``weight_update_mode: xccl`` in the recipe; the controller configures the route before updates."""

    _hex_sender: RelaySender | None = None
    _hex_report: dict[str, Any] | None = None

    @classmethod
    def as_controller(cls, config, scheduler):
        if config._version == "v2":
            raise NotImplementedError("hex.transport=relay needs the v1 controllers (actor._version: v1)")
        from areal_hex_plugin.transport.controller_adapter import HexPPOActorController

        return HexPPOActorController(train_engine=cls, config=config, scheduler=scheduler)

    # -- called by HexPPOActorController through the train workers' /call --------------------------------

    def hex_configure_transport(self, route: dict[str, Any], options: dict[str, Any]) -> None:
        """(Re)build the sender on rank 0 from a route of rollout receivers (``Route.to_dict`` form)."""
        import torch.distributed as dist

        if dist.get_rank() != 0:
            return
        if self._hex_sender is not None:
            self._hex_sender.close()
        self._hex_sender = RelaySender(Route.from_dict(route), SenderConfig(**options))

    def hex_commit(self) -> dict[str, Any] | None:
        """Second phase: every verified replica switches to the staged version. Rank 0 answers."""
        if self._hex_sender is None or self._hex_report is None:
            return None
        self._hex_sender.commit()
        report, self._hex_report = self._hex_report, None
        report["committed"] = list(self._hex_sender.last_report.committed)
        report["failed"] = dict(self._hex_sender.last_report.failed)
        return report

    def hex_abort(self) -> None:
        if self._hex_sender is not None:
            self._hex_sender.abort()
            self._hex_report = None

    # -- upstream seams ----------------------------------------------------------------------------------

    def _init_weight_update_from_distributed(self, meta) -> None:
        # No static NCCL group with every rollout GPU: receivers are reached through the route instead.
        self.weight_update_group_names = []
        self.weight_update_groups = []
        self.weight_update_master_addr = ""
        self.weight_update_master_port = 0

    def _update_weights_from_distributed(self, meta) -> None:
        import torch.distributed as dist

        main_rank = dist.get_rank() == 0
        failure: Exception | None = None
        if main_rank:
            failure = self._hex_begin(meta.version if meta.version is not None else self.get_version() + 1)
        # Every rank learns whether rank 0 could begin, so none waits in upstream's collectives for it.
        outcome = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        dist.broadcast_object_list(outcome, src=0, group=self.cpu_group)
        if failure is not None:
            raise failure
        if outcome[0] is not None:
            raise TransportError(f"hex transport: rank 0 could not begin the weight update ({outcome[0]})")
        super()._update_weights_from_distributed(meta)
        if main_rank:
            report = self._hex_sender.finish(commit=False)
            self._hex_report = {
                "version": report.version,
                "digest": report.digest,
                "bytes": report.nbytes,
                "seconds": report.seconds,
                "phases": report.phases,
                "failed": report.failed,
                "resent_buckets": report.resent_buckets,
                "reroutes": report.reroutes,
            }

    def _hex_begin(self, version: int) -> Exception | None:
        """Rank 0: begin the version on the sender; on failure abort it and return the error to raise."""
        if self._hex_sender is None:
            return RuntimeError("hex transport: no route yet (HexPPOActorController configures it)")
        try:
            self._hex_sender.begin(version)
        except Exception as error:  # noqa: BLE001 - raised on every rank after the broadcast
            self._hex_sender.abort()
            return error
        return None

    def _update_bucket_weights_from_distributed_async(self, meta, named_tensors, stream=None):
        # Packing copies the bucket to host memory, so upstream may reuse its buffers at once.
        self._hex_sender.send_bucket(named_tensors)
        return None
