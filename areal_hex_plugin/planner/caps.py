"""What the runtime that will run a plan can run, as data the search reads (no upstream import).

The planner builds only layouts its :class:`RuntimeCaps` allows (training layouts in ``train_search``, rollout
replica shapes in ``evaluate``), and ``areal/worker_slots.py`` checks a plan against the same object, so the plan
``areal-hex plan`` shows is the plan the driver runs. :data:`PAPER` is the paper's unconstrained space.

Upstream AReaL 1.0.4, as the plugin drives it:
- FSDP trains one pipeline stage on one GPU type (``fsdp:dXtY``), sharded over all its dp ranks: upstream's
  ``parallelize_model`` (``engine/fsdp_utils/parallel.py``) hands ``fully_shard`` the one flattened ``dp_sp`` mesh
  and no replicate dimension, and no setting changes that, so hybrid sharding (shard within a machine, replicate
  across machines) is the paper space's only;
- Megatron trains ``pp`` stages with one dp and one tp for all of them (``megatron:dXpZtY``); the plugin gives
  each stage its own GPU type and layer count;
- every rollout server is one upstream worker on ``tp*pp`` GPUs of one machine, each with its own layout;
- weight updates: the relay transport (per server, any layouts) from either actor (every FSDP rank, every
  Megatron pipeline stage sends its own part); upstream's xccl path needs one
  rollout layout (on Megatron also train pp = rollout pp when rollout pp > 1, so servers keep pp 1); disk works
  with any;
- ``hex_slurm``: a node's tasks share one GPU count, so each pool's servers share one layout; and each role is a
  job of its own that Slurm gives GPUs of its choosing, so a machine is not split between the roles there
  (hex_local and hex_ray pin every worker to its planned GPU ids: a machine may be, as upstream's
  ``sglang.d4+fsdp.d4`` on one node).
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.planner.train_search import depths, tp_degrees

TRAIN_BACKENDS = ("fsdp", "megatron")
# Weight-update paths each training backend supports in the plugin.
WEIGHT_PATHS = {"fsdp": ("relay", "xccl", "disk"), "megatron": ("relay", "xccl", "disk")}


@dataclass(frozen=True)
class RuntimeCaps:
    """The layouts a runtime can start. ``max_train_stages`` None: ``hex.solver.max_pp_stages``."""

    name: str
    max_train_stages: int | None = None
    train_mixed_types: bool = True  # pipeline stages on different GPU types
    train_equal_stages: bool = False  # every stage has the same dp and tp
    train_hybrid_sharding: bool = True  # FSDP sharded within each machine and replicated across machines
    # A rollout server's tp*pp GPUs sit in one machine, packed exactly.
    rollout_server_in_machine: bool = False
    one_rollout_layout: bool = False  # every rollout server has the same (tp, pp)
    max_rollout_pp: int | None = None  # None: hex.solver.max_pp_stages
    one_layout_per_pool: bool = False  # hex_slurm: a node's tasks share one GPU count
    split_machines: bool = True  # a machine's GPUs may go to both roles (not hex_slurm)
    weight_path: str = "relay"

    def train_stages(self, max_pp_stages: int) -> int:
        return max_pp_stages if self.max_train_stages is None else min(self.max_train_stages, max_pp_stages)

    def rollout_shapes(
        self, gpus_per_machine: int, max_pp_stages: int, fixed: list[int]
    ) -> list[tuple[int, int]]:
        """The replica shapes (tp, pp) a pool of ``gpus_per_machine``-GPU machines may run: TP inside a machine,
        at most ``max_pp_stages`` stages (and this runtime's limit) on the search's :func:`depths` ladder,
        ``fixed`` = hex.solver.rollout_layout."""
        in_machine = tp_degrees(gpus_per_machine)
        max_pp = min(max_pp_stages, self.max_rollout_pp or max_pp_stages)
        return [
            (tp, pp)
            for pp in depths(max_pp)
            for tp in in_machine
            if (not fixed or [tp, pp] == fixed)
            # One upstream server per worker: its GPUs in one machine, packed exactly.
            and (not self.rollout_server_in_machine or tp * pp in in_machine)
        ]

    def describe(self) -> str:
        if self.name == "paper":
            return "the paper's unconstrained space"
        train = {
            "fsdp": "one training stage on one GPU type",
            "megatron": "training stages with one dp and tp, on any GPU types",
        }[self.name]
        if self.one_rollout_layout:
            rollout = "one layout for every rollout server"
        elif self.one_layout_per_pool:
            rollout = "one rollout layout per pool (hex_slurm)"
        else:
            rollout = "a layout per replica group"
        return f"{self.name} + sglang ({train}; {rollout}; weights by {self.weight_path})"


PAPER = RuntimeCaps("paper")


def backend_kind(backend: str, field: str) -> str:
    """The backend name of an upstream allocation string such as ``fsdp:d8`` or ``megatron:d2p2t2``."""
    kind = str(backend).split(":", 1)[0].strip()
    if kind not in TRAIN_BACKENDS:
        raise HexError(
            field,
            f"backend {kind!r} is not one the plugin can plan for",
            f"use one of {', '.join(TRAIN_BACKENDS)} (e.g. fsdp:d8)",
        )
    return kind


def caps_for(
    train_backend: str, transport: str, weight_update_mode: str, scheduler: str | None = None
) -> RuntimeCaps:
    """The caps of upstream with this actor backend kind, ``hex.transport``, ``actor.weight_update_mode`` and
    ``scheduler.type``."""
    path = "relay" if transport == "relay" else weight_update_mode
    if path not in WEIGHT_PATHS[train_backend]:
        raise HexError(
            "actor.weight_update_mode",
            f"{weight_update_mode!r} is not a weight-update path a {train_backend} actor supports",
            f"use one of {', '.join(p for p in WEIGHT_PATHS[train_backend] if p != 'relay')}",
        )
    fsdp = train_backend == "fsdp"
    return RuntimeCaps(
        name=train_backend,
        max_train_stages=1 if fsdp else None,
        train_mixed_types=not fsdp,
        train_equal_stages=True,
        train_hybrid_sharding=False,
        rollout_server_in_machine=True,
        one_rollout_layout=path == "xccl",
        # Upstream's Megatron xccl path needs train pp = rollout pp when rollout pp > 1: servers keep pp 1.
        max_rollout_pp=1 if (path == "xccl" and not fsdp) else None,
        # A Slurm heterogeneous job gives every task of a node one GPU count.
        one_layout_per_pool=scheduler == "hex_slurm",
        split_machines=scheduler != "hex_slurm",
        weight_path=path,
    )


def recipe_caps(recipe) -> RuntimeCaps:
    """The caps of the backends the recipe's upstream part names (``actor.backend``, ``hex.transport``,
    ``actor.weight_update_mode``, ``scheduler.type``)."""
    actor = recipe.config.get("actor") or {}
    kind = backend_kind(actor.get("backend", "fsdp"), "actor.backend")
    scheduler = (recipe.config.get("scheduler") or {}).get("type")
    return caps_for(kind, recipe.hex.transport, actor.get("weight_update_mode", "xccl"), scheduler)


def unmet(plan, caps: RuntimeCaps) -> dict[str, str]:
    """``{capability: reason}`` for every part of ``plan`` (a HexPlan) that ``caps`` cannot start; empty: it
    runs."""
    out: dict[str, str] = {}
    stages = plan.train.stages
    if caps.max_train_stages is not None and len(stages) > caps.max_train_stages:
        out["training stages"] = (
            f"the plan pipelines training over {len(stages)} stages; {caps.name} runs one"
        )
    if not caps.train_mixed_types and len({s.gpu_type for s in stages}) > 1:
        out["training GPU types"] = f"the plan trains on {len({s.gpu_type for s in stages})} GPU types"
    if caps.train_equal_stages and len({(s.dp, s.tp) for s in stages}) > 1:
        shown = ", ".join(f"dp{s.dp} tp{s.tp}" for s in stages)
        out["training stage layouts"] = (
            f"stages differ in dp or tp ({shown}); {caps.name} gives all one dp and tp"
        )
    if not caps.train_hybrid_sharding and any(s.hybrid for s in stages):
        out["hybrid sharding"] = (
            "the plan shards training state within each machine and replicates it across machines; upstream "
            "areal 1.0.4's FSDP engine shards over all dp ranks (one dp mesh, fsdp_utils/parallel.py), with no "
            "setting for a replicate dimension"
        )
    groups = plan.rollout.replicas
    machine_gpus = {m.pool: len(m.gpus) for m in plan.machines}
    if caps.rollout_server_in_machine:
        wide = [g for g in groups if g.tp * g.pp not in tp_degrees(machine_gpus.get(g.pool, g.tp * g.pp))]
        if wide:
            shown = ", ".join(f"{g.pool} tp{g.tp} pp{g.pp}" for g in wide)
            out["rollout servers"] = f"servers must fit one machine's GPUs, packed exactly: {shown} do not"
    if caps.max_rollout_pp is not None and any(g.pp > caps.max_rollout_pp for g in groups):
        out["rollout pipeline"] = (
            f"upstream's {caps.name} {caps.weight_path} path needs train pp = rollout pp; the plan's servers run "
            f"pp up to {max(g.pp for g in groups)}"
        )
    if not caps.split_machines and any(m.role == "split" for m in plan.machines):
        out["split machines"] = (
            "the plan splits a machine between training and rollout; hex_slurm gives each role's job GPUs of "
            "Slurm's choosing"
        )
    per_pool: dict[str, set] = {}
    for g in groups:
        per_pool.setdefault(g.pool, set()).add((g.tp, g.pp))
    if caps.one_layout_per_pool and any(len(v) > 1 for v in per_pool.values()):
        out["rollout layouts per pool"] = (
            "a Slurm node's tasks share one GPU count; pools "
            f"{', '.join(p for p, v in per_pool.items() if len(v) > 1)} run servers of several layouts"
        )
    layouts = sorted({(g.tp, g.pp) for g in groups})
    if caps.one_rollout_layout and len(layouts) > 1:
        shown = ", ".join(f"tp{tp} pp{pp}" for tp, pp in layouts)
        out["rollout layouts"] = (
            f"upstream's {caps.weight_path} weight update gives server i rank offset 1 + i*tp*pp of one layout; "
            f"the plan runs {shown} (hex.transport=relay updates each server on its own)"
        )
    return out
