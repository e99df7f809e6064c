"""The relay's seams inside a training engine, shared by the FSDP and the Megatron actor: every sending rank
sends its own part of the version, rank 0 coordinates.

Rank 0 holds the :class:`RelaySender` (the control channels; part 0). For a version it prepares the chains and
broadcasts the sessions (:meth:`RelaySender.assignment`) over the engine's CPU group; every other sending rank
opens a :class:`PartSender` and pushes the buckets it owns to each pool's relay over its own NIC. After the
engine's loop the parts' summaries are gathered to rank 0, which waits for every replica to hold every part and
verifies (the replicas stage, still serving the old version); what another part must send again after a re-route
or a bad checksum goes back to its rank in repair rounds. The outcome is broadcast, so every rank raises together. The commit is the controller's second call (``hex_commit``), answered by rank 0.

Which ranks send and which part each sends is the engine's: FSDP ranks each own a share of the gathered tensors
(``fsdp_adapter.py``), Megatron's pipeline heads send the layers of their stage (``areal/megatron_actor.py``).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.transport.route import Route
from areal_hex_plugin.transport.sender import PartSender, PartSummary, RelaySender, SenderConfig
from areal_hex_plugin.transport.wire import TransportError, load_token


def source_hosts(route: Route) -> set[str]:
    """The addresses this machine reaches each pool's replicas from (what their nodes see as its peer address)."""
    hosts = set()
    for endpoint in (replica for pool in route.pools for replica in pool.replicas):
        family = socket.AF_INET6 if ":" in endpoint.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((endpoint.host, endpoint.port))  # UDP: picks the route, sends nothing
            hosts.add(probe.getsockname()[0])
    return hosts


class RelayTrainSide:
    """Mixed into a train engine that has ``cpu_group``; the engine says which part this rank sends."""

    _hex_sender: RelaySender | None = None
    _hex_part: RelaySender | PartSender | None = None
    # This rank's PartSender, kept with its data links from version to version.
    _hex_part_sender: PartSender | None = None
    _hex_report: dict[str, Any] | None = None

    @classmethod
    def as_controller(cls, config, scheduler):
        if config._version == "v2":
            raise NotImplementedError("hex.transport=relay needs the v1 controllers (actor._version: v1)")
        from areal_hex_plugin.transport.controller_adapter import HexPPOActorController

        return HexPPOActorController(train_engine=cls, config=config, scheduler=scheduler)

    # -- what the engine defines -------------------------------------------------------------------------

    def hex_parts(self) -> int:
        """How many parts (senders) make a version."""
        raise NotImplementedError

    def hex_part_index(self) -> int | None:
        """The part this rank sends (0 on rank 0), None when it sends none."""
        raise NotImplementedError

    # -- called by HexPPOActorController through the train workers' /call --------------------------------

    def hex_configure_transport(self, route: dict[str, Any], options: dict[str, Any]) -> None:
        """(Re)build the coordinator on rank 0 from a route of rollout receivers (``Route.to_dict`` form); every
        rank takes part (the other senders' addresses are gathered for the relays' allow-lists)."""
        parsed = Route.from_dict(route)
        self._hex_close_part_sender()  # its links go to the old route's relays
        mine, problem = set(), ""
        if self.hex_part_index() not in (None, 0):
            try:  # refused here, on rank 0 for all: a sender that fails alone would leave the others waiting
                load_token()
                mine = source_hosts(parsed)
            except (HexError, OSError) as error:
                problem = f"rank {dist.get_rank()}: {error}"
        gathered = _gather(self.cpu_group, (mine, problem))
        if dist.get_rank() != 0:
            return
        problems = [problem for _, problem in gathered if problem]
        if problems:
            raise TransportError(f"hex transport: a sending rank cannot send ({'; '.join(problems)})")
        if self._hex_sender is not None:
            self._hex_sender.close()
        senders = ["", *set().union(*(hosts for hosts, _ in gathered))]
        self._hex_sender = RelaySender(
            parsed, SenderConfig(**options), parts=self.hex_parts(), sender_hosts=senders
        )

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

    # -- one version, every rank ---------------------------------------------------------------------------

    def hex_begin(self, version: int) -> None:
        """Rank 0 begins the version; every sending rank gets its sender. Raises on every rank if rank 0 could
        not begin (so none waits in the engine's collectives for it)."""
        failure, assignment = None, None
        if dist.get_rank() == 0:
            failure = self._hex_begin_coordinator(version)
            assignment = None if failure else self._hex_sender.assignment()
        assignment = _from_rank0(
            self.cpu_group, failure, assignment, "rank 0 could not begin the weight update"
        )
        part = self.hex_part_index()
        if part == 0:
            self._hex_part = self._hex_sender
        elif part is not None:
            kept = self._hex_part_sender
            if kept is not None and kept.part == part and kept.parts == assignment["parts"]:
                kept.begin(assignment)
            else:
                self._hex_close_part_sender()
                self._hex_part_sender = PartSender(assignment, part)
            self._hex_part = self._hex_part_sender

    def hex_on_rank0(self, call: Callable[[], None], what: str) -> None:
        """Rank 0 makes ``call`` (the rollout's pause or resume) for every rank. A failure there raises on every
        rank, the begun version abandoned (behind a barrier, the other ranks would wait for a rank 0 that had
        left: the run hung)."""
        failure = None
        if dist.get_rank() == 0:
            try:
                call()
            except Exception as error:  # noqa: BLE001 - raised on every rank after the broadcast
                failure = error
        try:
            _from_rank0(self.cpu_group, failure, None, f"rank 0 could not {what}")
        except Exception:
            self.hex_abort()
            self._hex_close_part_sender()
            self._hex_part = None
            raise

    def hex_send(self, named_tensors) -> None:
        """A bucket of this rank's part (packing copies it to host memory, so the caller may reuse its buffers)."""
        assert self._hex_part is not None, "this rank sends no part"
        self._hex_part.send_bucket(named_tensors)

    def hex_finish(self) -> None:
        """Every rank: hand this rank's part summary to rank 0, which waits for every part on every replica; what
        a part must send again (``RelaySender.settle``) goes back to every rank and is sent, round after round;
        then rank 0 verifies. Raises on every rank if that failed (then no replica switches)."""
        part = self._hex_part
        summary = part.finish() if isinstance(part, PartSender) else None
        verified = False
        try:
            while True:
                summaries = [s for s in _gather(self.cpu_group, summary) if s is not None]
                failure, plan = None, None
                if dist.get_rank() == 0:
                    try:
                        plan = self._hex_sender.settle(summaries)
                        if plan is None:
                            report = self._hex_sender.finish(commit=False, parts=summaries)
                            self._hex_report = _report_fields(
                                report, [self._hex_sender.summary(), *summaries]
                            )
                    except Exception as error:  # noqa: BLE001 - raised on every rank after the broadcast
                        failure = error
                plan = _from_rank0(self.cpu_group, failure, plan, "the weight update failed on rank 0")
                if plan is None:
                    verified = True
                    return
                if isinstance(part, PartSender):
                    summary = part.repair(plan)
        finally:
            if isinstance(part, PartSender):
                part.release()  # its buckets; the links stay for the next version unless this one failed
                if not verified:
                    self._hex_close_part_sender()
            self._hex_part = None

    def _hex_close_part_sender(self) -> None:
        if self._hex_part_sender is not None:
            self._hex_part_sender.close()
            self._hex_part_sender = None

    def _hex_begin_coordinator(self, version: int) -> Exception | None:
        if self._hex_sender is None:
            return RuntimeError("hex transport: no route yet (HexPPOActorController configures it)")
        try:
            self._hex_sender.begin(version)
        except Exception as error:  # noqa: BLE001 - raised on every rank after the broadcast
            self._hex_sender.abort()
            return error
        return None


def _gather(group, value: Any) -> list[Any]:
    """``value`` of every rank of ``group`` on rank 0 (in rank order); [] elsewhere."""
    out = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else None
    dist.gather_object(value, out, dst=0, group=group)
    return out or []


def _report_fields(report, summaries: list[PartSummary | None]) -> dict[str, Any]:
    return {
        "version": report.version,
        "digest": report.digest,
        "update": report.update,
        "bytes": report.nbytes,
        # What each part's sender put on its links (to every pool): about 1/parts of the version each.
        "part_bytes": [s.nbytes for s in sorted((s for s in summaries if s), key=lambda s: s.part)],
        "seconds": report.seconds,
        "phases": report.phases,
        "failed": report.failed,
        "resent_buckets": report.resent_buckets,
        "reroutes": report.reroutes,
    }


def _from_rank0(group, failure: Exception | None, value: Any, what: str) -> Any:
    """Rank 0's ``value`` on every rank, or its ``failure`` raised on every rank (as itself on rank 0)."""
    outcome = [None if failure is None else f"{type(failure).__name__}: {failure}", value]
    dist.broadcast_object_list(outcome, src=0, group=group)
    if failure is not None:
        raise failure
    if outcome[0] is not None:
        raise TransportError(f"hex transport: {what} ({outcome[0]})")
    return outcome[1]
