"""Weight-transport benchmark on emulated links: a ring-pipelined broadcast vs the Hex relay chain.

Processes stand in for a trainer and two rollout pools; every process gets its own Linux network namespace,
joined by veth pairs and one bridge per pool, with a ``tbf`` qdisc on each sending interface: the trainer's link
into each pool at the cross-pool rate, each replica's link at the intra-pool rate (the paper's 1.5 : 5, scaled to
what this machine carries). The trainer moves the state dict of a randomly initialised Qwen2-architecture model

* ``naive``: upstream's own update path (``xccl``: one NCCL group of the trainer and every rollout GPU, a broadcast
  per bucket) needs CUDA, and ``disk`` a shared filesystem, so neither can be driven here. It is stood in for by
  what NCCL's broadcast does inside it: a ring-pipelined broadcast (trainer, then every replica of pool 0, then of
  pool 1, ...; each rank forwards chunk k while chunk k+1 arrives) over one gloo group, with no verification and
  no commit;
* ``hex``: :class:`RelaySender` over gloo links (rendezvous over the authenticated channel), relay chain per pool,
  keyed digests per chunk, bucket and version, verify, commit. ``hex_s`` is the whole update as the trainer sees it:
  the version's set-up (sessions and data links along every chain), every bucket, verification and the commit on
  every replica. One sender serves all versions of a replica count, as the FSDP actor keeps one per route, so its
  control connections and data links are opened once (in the first repeat) and kept;
* ``hex`` with ``S`` senders (``--senders``, at ``--senders-replicas`` per pool): the version in S parts, as S
  training ranks send it, each from a namespace of its own with its own links into each pool at the cross-pool
  rate (its own NIC): the coordinator (:class:`RelaySender`, part 0) and S-1 :class:`PartSender` processes, each
  packing and sending the tensors it owns (dealt largest first to the part with the fewest bytes), repair rounds
  as the train side runs them, verify and commit. Its bound: every relay takes the whole model, each share through
  its sender's link at once (so the largest share sets it), and forwards it at the intra-pool rate.

The bound (one sender) is the model's bytes over the cross-pool rate: each pool's relay must take the whole model
through its pool's shaped link (``tbf`` counts frame bytes, so TCP/IP headers put even a perfect transfer about 4% above it).
``replica_cpu_s`` is the CPU time a replica spends per update: with more replicas than cores (this machine), that,
not the links, is what stretches an update past the bound.

Each is timed ``--repeats`` times per replica count and the median kept. Every replica hashes what it holds
afterwards (outside the timing) and the hash must equal the trainer's.

Integrity: ``digest`` holds benchmarks/digest.py's figures (GB/s per core of each candidate chunk MAC, the
transport's on its hashing pool, and the cores that keep up with 12.5 and 50 GB/s). ``hex_digest_off_s`` is the
relay with every chunk's MAC taken over its position alone (its bytes unhashed), a repeat of each in turn with
``hex_s``: the transport has no switch for it, so every worker of the benchmark swaps the chunk digest for that one
(``digest_on_over_off`` is the digest's share of the update).

Memory: each configuration runs on workers of its own, stopped (their staged copies removed) before the next
starts, so the largest configuration sets what the run needs: a replica holds about two versions staged in
/dev/shm and one more for the broadcast, a sender up to about five models (the trainer peaked at 4.5). The run
checks that estimate against MemAvailable and free /dev/shm before it starts and refuses, naming the flags that
shrink it, when it does not fit. At the default sizes (a 247 MB model, 1, 3 and 6 replicas per pool) the largest needs about 12.8 GiB. A worker that dies
fails its configuration alone (``error``: its exit cause, SIGKILL most likely the OOM killer, and its log, kept).

Needs root and iproute2; every namespace and every staged copy (under ``/dev/shm/hex-transport-<pid>-*``) is
removed on exit, failure, Ctrl-C, SIGTERM or the time limit, and a run killed outright (SIGKILL) leaves its
copies to the next run, which removes them first.

    sudo .venv/bin/python benchmarks/transport.py --json transport.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import hmac
import json
import math
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PORT = 29700
NAIVE_STORE_PORT = 29600


def _address(pool: int, replica: int | None) -> str:
    return f"10.77.{pool + 1}.{254 if replica is None else replica + 1}"


def _sender_address(pool: int, part: int) -> str:
    """Where the sender of part ``part`` (1 and up) reaches pool ``pool`` from."""
    return f"10.77.{pool + 1}.{250 - part}"


# -- workers (run inside a namespace) ----------------------------------------------------------------------


def _answer(payload: dict) -> None:
    print(json.dumps(payload), flush=True)


def _sha(named_tensors) -> str:
    """Of the tensors by name (name, dtype, shape, bytes), whatever order they arrive in."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def _naive_group(address: str, rank: int, world: int, prefix: str, port: int):
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=300)
    store = dist.TCPStore(_address(0, None), port, world, rank == 0, timeout=timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world, options), store


def _ring(group, rank: int, world: int, flat, chunk: int) -> None:
    """Ring-pipelined broadcast from rank 0 (NCCL's broadcast algorithm): every rank but the first receives each
    chunk from its predecessor, and every rank but the last forwards it while the next chunk arrives."""
    sends = []
    for index, offset in enumerate(range(0, flat.numel(), chunk)):
        piece = flat[offset : offset + chunk]
        if rank > 0:
            group.recv([piece], rank - 1, index).wait()
        if rank < world - 1:
            sends.append(group.send([piece], rank + 1, index))
    for handle in sends:
        handle.wait()


def _model_state(hidden: int, layers: int, vocab: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        tie_word_embeddings=False,
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no float32 copy at twice the model's size
    try:
        model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def _model_bytes(hidden: int, layers: int, vocab: int) -> int:
    """The bytes of :func:`_model_state` (bf16), counted without building it; the trainer checks it."""
    intermediate, kv = hidden * 8 // 3 // 64 * 64, max(1, hidden // 256) * 64
    attention = 2 * hidden * hidden + hidden + 2 * (hidden * kv + kv)  # q, o; biases on q, k, v
    layer = attention + 3 * hidden * intermediate + 2 * hidden  # the MLP, two norms
    return 2 * (layers * layer + 2 * vocab * hidden + hidden)  # embeddings, head, final norm


def trainer_worker(args: argparse.Namespace) -> None:
    import torch

    from areal_hex_plugin.transport.route import Route
    from areal_hex_plugin.transport.sender import RelaySender, SenderConfig

    state = _model_state(args.hidden, args.layers, args.vocab)
    items = list(state.items())
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    manifest = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in items]
    shares = {  # the bytes each part sends, for each number of senders
        parts: [
            sum(t.numel() * t.element_size() for _, t in _share(items, part, parts)) for part in range(parts)
        ]
        for parts in args.senders
    }
    _answer(
        {
            "shares": shares,
            "nbytes": nbytes,
            "params": sum(t.numel() for t in state.values()),
            "sha": _sha(items),
            "manifest": manifest,
        }
    )
    sender = None
    for line in sys.stdin:
        command = json.loads(line)
        if command["t"] in _COMMON:
            _answer(_COMMON[command["t"]](command))
        elif command["t"] == "route":  # one sender per route, kept across versions like the FSDP actor's
            if sender is not None:
                sender.close()
            config = SenderConfig(backend="gloo", timeout_s=60.0, chunk_bytes=args.chunk_kb << 10)
            route, parts = Route.from_dict(command["route"]), command["parts"]
            sender = RelaySender(route, config, parts=parts, sender_hosts=["", *command["hosts"]])
            _answer({})
        elif command["t"] == "hex":  # one sender: the whole version
            began = time.perf_counter()
            report = sender.send_version(command["version"], _buckets(items, args.bucket_mb))
            _answer(_outcome(report, time.perf_counter() - began))
        elif (
            command["t"] == "begin"
        ):  # part 0 of a version in parts: the other parts' senders get the assignment
            began = time.perf_counter()
            sender.begin(command["version"])
            _answer({"assignment": sender.assignment()})
            for bucket in _buckets(_share(items, 0, sender.assignment()["parts"]), args.bucket_mb):
                sender.send_bucket(bucket)
        elif command["t"] == "settle":
            plan = sender.settle(_summaries(command["summaries"]))
            _answer({"plan": plan})
        elif command["t"] == "finish":
            report = sender.finish(parts=_summaries(command["summaries"]))
            _answer(_outcome(report, time.perf_counter() - began))
        elif command["t"] == "naive":
            group, _store = _naive_group(
                _address(0, None), 0, command["world"], command["prefix"], command["port"]
            )
            flat = torch.cat([tensor.reshape(-1).view(torch.uint8) for _, tensor in items])
            group.barrier().wait()
            began = time.perf_counter()
            _ring(group, 0, command["world"], flat, args.chunk_kb << 10)
            group.barrier().wait()
            _answer({"seconds": time.perf_counter() - began})
            del group, _store
        else:
            if sender is not None:
                sender.close()
            return


def part_worker(args: argparse.Namespace) -> None:
    """A training rank that sends part ``--part`` of every version (its own buckets, over its own links)."""
    from areal_hex_plugin.transport.sender import PartSender

    items = list(_model_state(args.hidden, args.layers, args.vocab).items())
    sender = None
    _answer({})
    for line in sys.stdin:
        command = json.loads(line)
        if command["t"] in _COMMON:
            _answer(_COMMON[command["t"]](command))
        elif (
            command["t"] == "begin"
        ):  # kept from version to version, with its links, as the train side keeps it
            assignment = command["assignment"]
            if sender is None or sender.parts != assignment["parts"]:
                if sender is not None:
                    sender.close()
                sender = PartSender(assignment, args.part)
            else:
                sender.begin(assignment)
            for bucket in _buckets(_share(items, args.part, assignment["parts"]), args.bucket_mb):
                sender.send_bucket(bucket)
            _answer(_summary(sender.finish()))
        elif command["t"] == "repair":
            _answer(_summary(sender.repair(command["plan"])))
        elif command["t"] == "release":
            sender.release()
            _answer({})
        else:
            break
    if sender is not None:
        sender.close()


def _share(items: list, part: int, parts: int) -> list:
    """The tensors part ``part`` of ``parts`` sends, as training ranks each own a share: largest first, each to the
    part with the fewest bytes so far."""
    sizes, owner = [0] * parts, {}
    for name, tensor in sorted(items, key=lambda item: -item[1].numel() * item[1].element_size()):
        owner[name] = sizes.index(min(sizes))
        sizes[owner[name]] += tensor.numel() * tensor.element_size()
    return [(name, tensor) for name, tensor in items if owner[name] == part]


def _buckets(items: list, bucket_mb: int) -> list[list]:
    buckets, current, size = [], [], 0
    for name, tensor in items:
        if current and size + tensor.numel() * tensor.element_size() > bucket_mb << 20:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    buckets.append(current)
    return buckets


def _summary(summary) -> dict:
    return {"part": summary.part, "buckets": summary.buckets, "failed": summary.failed}


def _summaries(plain: list[dict]) -> list:
    from areal_hex_plugin.transport.sender import PartSummary

    return [PartSummary(**summary) for summary in plain]


def _outcome(report, seconds: float) -> dict:
    return {
        "seconds": seconds,
        "phases": report.phases,
        "committed": len(report.committed),
        "failed": report.failed,
    }


def _usage(command: dict) -> dict:
    """CPU seconds this process has used so far (every thread, user and system) and its peak resident bytes
    (staged weights it maps included)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_bytes": usage.ru_maxrss << 10}


_TRANSPORT_CHUNK_DIGEST = []  # the transport's own chunk digest, kept while the benchmark switches it off


def _switch_chunk_mac(command: dict) -> dict:
    """Off: every chunk's digest is a MAC of its position alone, its bytes unhashed; on: the transport's own. All
    workers switch together, so sender and receivers agree and the relay runs as usual minus the hashing. The
    transport itself has no such switch: this is how the benchmark times the relay with the digest off."""
    from areal_hex_plugin.transport import buckets

    if not _TRANSPORT_CHUNK_DIGEST:
        _TRANSPORT_CHUNK_DIGEST.append(buckets.chunk_digest)
    buckets.chunk_digest = _TRANSPORT_CHUNK_DIGEST[0] if command["on"] else _position_digest
    return {}


def _position_digest(key: bytes, index: int, chunk_index: int, data) -> str:
    return hmac.digest(key, index.to_bytes(4, "big") + chunk_index.to_bytes(8, "big"), "sha256").hex()


_COMMON = {"cpu": _usage, "mac": _switch_chunk_mac}  # commands every worker answers


class _KeepSink:
    """Keeps the committed tensors as received (views into the staged buckets), hashed only when asked, before
    another version is staged (the node reuses their memory for later versions)."""

    def __init__(self) -> None:
        self.version, self.named = -1, []

    def load(self, version, named_tensors) -> None:
        self.named, self.version = list(named_tensors), version


def replica_worker(args: argparse.Namespace) -> None:
    import torch

    from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode

    sink = _KeepSink()
    trainer = f"{args.address.rsplit('.', 1)[0]}.254"  # the trainer's address in this pool (_address)
    config = ReceiverConfig(
        bind_host=args.address, port=PORT, timeout_s=60.0, trainer_hosts=[trainer], stage_dir=args.stage_dir
    )
    node = ReceiverNode(sink, config)
    node.start()
    _answer({"ready": args.address})
    for line in sys.stdin:
        command = json.loads(line)
        if command["t"] in _COMMON:
            _answer(_COMMON[command["t"]](command))
        elif command["t"] == "hash":
            _answer({"version": sink.version, "sha": _sha(sink.named)})
        elif command["t"] == "naive":
            group, _store = _naive_group(
                args.address, command["rank"], command["world"], command["prefix"], command["port"]
            )
            flat = torch.empty(command["nbytes"], dtype=torch.uint8)
            group.barrier().wait()
            _ring(group, command["rank"], command["world"], flat, command["chunk"])
            group.barrier().wait()
            received, offset = [], 0
            for name, dtype, shape in command["manifest"]:  # views into what arrived: no second copy
                nbytes = math.prod(shape) * getattr(torch, dtype).itemsize
                received.append(
                    (name, flat[offset : offset + nbytes].view(getattr(torch, dtype)).view(shape))
                )
                offset += nbytes
            _answer({"sha": _sha(received)})
            del group, _store, flat, received
        else:
            break
    node.stop()


# -- the emulated network ------------------------------------------------------------------------------------


class Testbed:
    """Namespaces, veths, bridges and qdiscs for one trainer and ``pools`` x ``per_pool`` replicas."""

    def __init__(
        self, pools: int, per_pool: int, cross_mb_per_s: float, intra_mb_per_s: float, senders: int = 1
    ) -> None:
        self.tag = f"{os.getpid() % 10000:04d}"
        self.pools, self.per_pool, self.senders = pools, per_pool, senders
        self.cross, self.intra = cross_mb_per_s, intra_mb_per_s
        self.namespaces: list[str] = []
        self.root_links: list[str] = []

    def ns(self, pool: int | None = None, replica: int | None = None, bridge: bool = False) -> str:
        if pool is None:
            return f"hxb{self.tag}-trainer"
        return f"hxb{self.tag}-p{pool}" + ("-bridge" if bridge else f"-r{replica}")

    def sender_ns(self, part: int) -> str:
        return f"hxb{self.tag}-s{part}"

    def _ip(self, *argv: str) -> None:
        subprocess.run(["ip", *argv], check=True, capture_output=True, text=True)

    def _netns(self, name: str) -> None:
        self._ip("netns", "add", name)
        self.namespaces.append(name)
        self._ip("-n", name, "link", "set", "lo", "up")

    def _veth(self, inner_ns: str, inner_name: str, bridge_ns: str, label: str) -> None:
        outer, peer = f"hx{self.tag}{label}a", f"hx{self.tag}{label}b"
        self._ip("link", "add", outer, "type", "veth", "peer", "name", peer)
        self.root_links.append(outer)
        self._ip("link", "set", outer, "netns", inner_ns)
        self._ip("-n", inner_ns, "link", "set", outer, "name", inner_name)
        self._ip("link", "set", peer, "netns", bridge_ns)
        self._ip("-n", bridge_ns, "link", "set", peer, "master", "br0")
        self._ip("-n", bridge_ns, "link", "set", peer, "up")
        self._ip("-n", inner_ns, "link", "set", inner_name, "up")

    def _shape(self, namespace: str, device: str, mb_per_s: float) -> None:
        rate = f"{int(mb_per_s * 8)}mbit"
        subprocess.run(
            ["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate", rate,
             "burst", "256kb", "latency", "100ms"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip

    def __enter__(self) -> Testbed:
        try:
            trainer = self.ns()
            self._netns(trainer)
            subprocess.run(
                ["ip", "netns", "exec", trainer, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
                check=True,
                capture_output=True,
            )
            for pool in range(self.pools):
                bridge = self.ns(pool, bridge=True)
                self._netns(bridge)
                self._ip("-n", bridge, "link", "add", "br0", "type", "bridge")
                self._ip("-n", bridge, "link", "set", "br0", "up")
                self._veth(trainer, f"to{pool}", bridge, f"t{pool}")
                self._ip("-n", trainer, "addr", "add", f"{_address(pool, None)}/24", "dev", f"to{pool}")
                self._shape(trainer, f"to{pool}", self.cross)
                for replica in range(self.per_pool):
                    name = self.ns(pool, replica)
                    self._netns(name)
                    self._veth(name, "eth0", bridge, f"p{pool}r{replica}")
                    self._ip("-n", name, "addr", "add", f"{_address(pool, replica)}/24", "dev", "eth0")
                    self._ip("-n", name, "route", "add", "default", "via", _address(pool, None))
                    self._shape(name, "eth0", self.intra)
            for part in range(1, self.senders):  # another training rank: its own links into every pool
                name = self.sender_ns(part)
                self._netns(name)
                for pool in range(self.pools):
                    self._veth(name, f"to{pool}", self.ns(pool, bridge=True), f"s{part}p{pool}")
                    self._ip(
                        "-n", name, "addr", "add", f"{_sender_address(pool, part)}/24", "dev", f"to{pool}"
                    )
                    self._shape(name, f"to{pool}", self.cross)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for name in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        for link in self.root_links:  # only left in the root namespace if set-up failed half-way
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        self.namespaces, self.root_links = [], []


# -- orchestration ---------------------------------------------------------------------------------------------

POOLS = 2
SHM = Path("/dev/shm")
SHM_PREFIX = "hex-transport-"
GIB = 1 << 30
# What a worker holds besides the model's bytes (Python, torch, gloo, the transport's threads), and what each
# holds per byte of the model: measured as peak RSS at the default sizes on this project's 2-core machine (torch
# 2.13 CPU; `peak_rss_bytes` in each run), rounded up. A replica maps two versions staged in /dev/shm (the
# committed one and the one arriving, or its spare pages) and, for the broadcast, a third copy of its own.
SENDER_BASE_BYTES = 384 << 20  # measured 313 MiB (transformers imported)
SENDER_MODELS = (
    5  # the state dict, the buckets being packed, the broadcast's flat copy, what gloo holds in flight
)
REPLICA_BASE_BYTES = 256 << 20  # measured 232 MiB
REPLICA_MODELS = 1  # the broadcast's bytes
REPLICA_STAGED_MODELS = 2


class WorkerDied(RuntimeError):
    """A worker ended before it answered; the message holds its exit cause and the log it left."""


def _exit_cause(returncode: int) -> str:
    if returncode >= 0:
        return f"exit status {returncode}"
    name = signal.Signals(-returncode).name
    if -returncode == signal.SIGKILL:
        return f"{name}: likely the kernel's OOM killer, read `dmesg | grep -i -A5 'out of memory'`"
    return name


class Worker:
    """A process that answers JSON lines on stdout to the commands it reads on stdin; its stderr goes to ``log``."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log_path, self.log = name, log, log.open("w")
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )

    def send(self, command: dict) -> None:
        try:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None

    def read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise self._died()
        return json.loads(line)

    def _died(self) -> WorkerDied:
        try:
            cause = _exit_cause(self.process.wait(timeout=10))
        except subprocess.TimeoutExpired:
            cause = "closed its output but still runs"
        return WorkerDied(f"{self.name} ended early ({cause}); its log: {self.log_path}")

    def stop(self) -> None:
        with contextlib.suppress(OSError, WorkerDied):
            self.send({"t": "exit"})
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def _in_namespace(namespace: str, argv: list[str]) -> list[str]:
    """The command that runs this file as a worker (``argv``) in ``namespace``."""
    return ["ip", "netns", "exec", namespace, sys.executable, __file__, *argv]


def _configurations(args) -> list[tuple[int, int]]:
    """(replicas per pool, senders) of every configuration, in the order they run."""
    return [(per_pool, 1) for per_pool in args.replicas] + [(args.senders_replicas, s) for s in args.senders]


def _memory_needed(args, per_pool: int, senders: int) -> tuple[int, int]:
    """(bytes of memory, of them staged in /dev/shm) that one configuration's workers hold at most."""
    model = _model_bytes(args.hidden, args.layers, args.vocab)
    replicas = POOLS * per_pool
    staged = replicas * REPLICA_STAGED_MODELS * model
    own = senders * (SENDER_BASE_BYTES + SENDER_MODELS * model)
    own += replicas * (REPLICA_BASE_BYTES + REPLICA_MODELS * model)
    return own + staged, staged


def _mem_available() -> int:
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields["MemAvailable"].split()[0]) << 10


def _check_memory(args) -> str:
    """Why the largest configuration does not fit this machine's free memory and /dev/shm ('' when it fits)."""
    (memory, staged), (per_pool, senders) = max(
        (_memory_needed(args, *config), config) for config in _configurations(args)
    )
    shm_free = shutil.disk_usage(SHM).free
    available = _mem_available()
    if memory <= available and staged <= shm_free:
        return ""
    return (
        f"not enough memory: the largest configuration ({per_pool} replicas per pool, {senders} sender(s)) needs "
        f"about {memory / GIB:.1f} GiB, {staged / GIB:.1f} GiB of it staged in {SHM}; this machine has "
        f"{available / GIB:.1f} GiB available and {shm_free / GIB:.1f} GiB free in {SHM}. Pass fewer --replicas "
        f"(or --senders-replicas), or a smaller model (--layers, --hidden); nothing was run"
    )


def _reclaim_staged() -> None:
    """Remove what an earlier run killed from outside (SIGKILL) left staged in /dev/shm."""
    for left in SHM.glob(f"{SHM_PREFIX}*"):
        owner = left.name.removeprefix(SHM_PREFIX).split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(left, ignore_errors=True)


def _digest_figures(args) -> dict:
    """benchmarks/digest.py (a ``--digest-mb`` bf16 bucket in 4 MiB chunks) in a process of its own, its memory
    gone before the workers start."""
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("digest.py")), "--repeats", str(args.digest_repeats),
         "--bucket-mb", str(args.digest_mb)],
        capture_output=True, text=True, check=True, env=_env(),
    )  # fmt: skip
    return json.loads(run.stdout)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))


def _run(args: argparse.Namespace, workdir: Path, staged: Path) -> dict:
    digest = _digest_figures(args)
    env = dict(_env(), AREAL_HEX_TRANSPORT_TOKEN=secrets.token_hex(16))
    per_pool_max = max(per_pool for per_pool, _ in _configurations(args))
    runs, sender_runs = [], []
    with Testbed(
        POOLS, per_pool_max, args.cross_mb_per_s, args.intra_mb_per_s, max(args.senders, default=1)
    ) as bed:
        for per_pool, senders in _configurations(args):
            result = _configuration(args, bed, env, workdir, staged, per_pool, senders)
            (runs if senders == 1 else sender_runs).append(result)
            if args.json:  # what is measured so far survives the time limit
                args.json.write_text(json.dumps(_summarise(args, digest, runs, sender_runs), indent=2) + "\n")
    return _summarise(args, digest, runs, sender_runs)


def _configuration(args, bed: Testbed, env: dict, workdir: Path, staged: Path, per_pool: int, senders: int):
    """One configuration on workers of its own, stopped after it with their staged copies removed, so memory holds
    one configuration at a time; a worker that dies fails this configuration alone."""
    logs = workdir / (f"replicas-{per_pool}" if senders == 1 else f"senders-{senders}")
    logs.mkdir()
    model_argv = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)]
    model_argv += ["--bucket-mb", str(args.bucket_mb)]
    workers: list[Worker] = []
    try:
        trainer_argv = ["--worker", "trainer", *model_argv, "--chunk-kb", str(args.chunk_kb)]
        trainer_argv += ["--senders", str(senders)]
        trainer = Worker("trainer", _in_namespace(bed.ns(), trainer_argv), env, logs / "trainer.log")
        workers.append(trainer)
        used = []
        for pool in range(POOLS):
            for replica in range(per_pool):
                argv = [
                    "--worker",
                    "replica",
                    "--address",
                    _address(pool, replica),
                    "--stage-dir",
                    str(staged),
                ]
                name = f"replica-{pool}-{replica}"
                used.append(
                    Worker(name, _in_namespace(bed.ns(pool, replica), argv), env, logs / f"{name}.log")
                )
        parts = []
        for part in range(1, senders):
            argv = ["--worker", "part", "--part", str(part), *model_argv]
            parts.append(
                Worker(
                    f"part-{part}", _in_namespace(bed.sender_ns(part), argv), env, logs / f"part-{part}.log"
                )
            )
        workers += [*used, *parts]
        model = trainer.read()
        _check_model_bytes(args, model["nbytes"])
        for worker in [*used, *parts]:
            worker.read()
        if senders == 1:
            result = _one_config(args, trainer, used, model, per_pool)
        else:
            result = _senders_config(args, trainer, parts, used, model)
        result["staged_bytes"] = _tree_bytes(staged)
        result["peak_rss_bytes"] = _peaks(trainer, used, parts)
        return result
    except WorkerDied as died:
        print(f"{logs.name}: {died}", file=sys.stderr)
        return {"replicas_per_pool": per_pool, "senders": senders, "error": str(died)}
    finally:
        for worker in workers:
            worker.stop()
        for left in staged.iterdir():
            shutil.rmtree(left, ignore_errors=True)


def _check_model_bytes(args, nbytes: int) -> None:
    counted = _model_bytes(args.hidden, args.layers, args.vocab)
    if counted != nbytes:
        raise RuntimeError(f"_model_bytes counts {counted} bytes, the model has {nbytes}: fix _model_bytes")


def _tree_bytes(root: Path) -> int:
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file())


def _peaks(trainer: Worker, replicas: list[Worker], parts: list[Worker]) -> dict:
    """The most resident bytes each kind of worker held (a replica's staged pages it maps included)."""
    peaks = {}
    for kind, workers in (("trainer", [trainer]), ("replica", replicas), ("part", parts)):
        for worker in workers:
            worker.send({"t": "cpu"})
        if workers:
            peaks[kind] = max(worker.read()["peak_rss_bytes"] for worker in workers)
    return peaks


def _route(args, pools: int, per_pool: int) -> dict:
    return {
        "pools": [
            {
                "name": f"pool{pool}",
                "replicas": [f"{_address(pool, replica)}:{PORT}" for replica in range(per_pool)],
                "cross_gb_per_s": args.cross_mb_per_s / 1e3,
                "intra_gb_per_s": args.intra_mb_per_s / 1e3,
            }
            for pool in range(pools)
        ]
    }


def _senders_config(args, trainer: Worker, parts: list[Worker], used: list[Worker], model: dict) -> dict:
    """The version in ``len(parts) + 1`` parts, each part's sender in its own namespace (its own links)."""
    senders, per_pool = len(parts) + 1, args.senders_replicas
    hosts = [_sender_address(pool, part) for part in range(1, senders) for pool in range(POOLS)]
    trainer.send({"t": "route", "route": _route(args, POOLS, per_pool), "parts": senders, "hosts": hosts})
    trainer.read()
    cpu_before = _cpu([*used, trainer, *parts])
    hex_runs, first = [], 10000 + senders * 100
    for attempt in range(args.repeats):
        trainer.send({"t": "begin", "version": first + attempt})
        assignment = trainer.read()["assignment"]
        for part in parts:
            part.send({"t": "begin", "assignment": assignment})
        summaries = [part.read() for part in parts]
        while True:  # repair rounds, as the train side runs them
            trainer.send({"t": "settle", "summaries": summaries})
            plan = trainer.read()["plan"]
            if plan is None:
                break
            for part in parts:
                part.send({"t": "repair", "plan": plan})
            summaries = [part.read() for part in parts]
        trainer.send({"t": "finish", "summaries": summaries})
        hex_runs.append(trainer.read())
        for part in parts:
            part.send({"t": "release"})
            part.read()
    cpu_s = _cpu([*used, trainer, *parts]) - cpu_before
    exact = _holds(used, model, first + args.repeats - 1)
    hex_s = statistics.median(run["seconds"] for run in hex_runs)
    # Every relay takes the whole model, each share through its sender's link at once, and forwards it in its pool.
    bound_s = max(model["shares"][str(senders)]) / 1e6 / args.cross_mb_per_s
    if per_pool > 1:
        bound_s = max(bound_s, model["nbytes"] / 1e6 / args.intra_mb_per_s)
    return {
        "senders": senders,
        "replicas_per_pool": per_pool,
        "hex_s": round(hex_s, 3),
        "hex_runs_s": [round(run["seconds"], 3) for run in hex_runs],
        "hex_phases_s": hex_runs[-1]["phases"],
        "bound_s": round(bound_s, 3),
        "hex_over_bound": round(hex_s / bound_s, 3),
        "share_bytes": model["shares"][str(senders)],
        "bit_exact": bool(exact),
        "cpu_s_per_update": round(cpu_s / args.repeats, 3),
        "hex_failed_replicas": sum(len(run["failed"]) for run in hex_runs),
    }


def _holds(replicas: list[Worker], model: dict, version: int) -> bool:
    """Whether every replica holds ``version`` with exactly the trainer's bytes."""
    exact = True
    for worker in replicas:
        worker.send({"t": "hash"})
        answer = worker.read()
        exact &= answer["sha"] == model["sha"] and answer["version"] == version
    return exact


def _set_chunk_mac(workers: list[Worker], on: bool) -> None:
    for worker in workers:
        worker.send({"t": "mac", "on": on})
    for worker in workers:
        worker.read()


def _one_config(args, trainer: Worker, used: list[Worker], model: dict, per_pool: int) -> dict:
    """The relay with the chunk digest on and off, a repeat of each in turn, then the ring broadcast."""
    trainer.send({"t": "route", "route": _route(args, POOLS, per_pool), "parts": 1, "hosts": []})
    trainer.read()
    runs: dict[bool, list[dict]] = {True: [], False: []}
    hex_cpu = 0.0
    for attempt in range(args.repeats):
        for on in (True, False):
            _set_chunk_mac([trainer, *used], on)
            cpu_before = _cpu(used)
            trainer.send({"t": "hex", "version": per_pool * 100 + 2 * attempt + (not on)})
            runs[on].append(trainer.read())
            if on:
                hex_cpu += _cpu(used) - cpu_before
    hex_runs = runs[True]
    hex_exact = _holds(used, model, per_pool * 100 + 2 * args.repeats - 1)
    naive_runs, naive_exact = [], True
    cpu_before = _cpu(used)
    for attempt in range(args.repeats):
        group = {
            "t": "naive",
            "world": 1 + len(used),
            "prefix": secrets.token_hex(4),
            "port": NAIVE_STORE_PORT + per_pool * 10 + attempt,
        }
        trainer.send(group)
        for rank, worker in enumerate(used, start=1):
            worker.send(
                {**group, "rank": rank, "manifest": model["manifest"], "nbytes": model["nbytes"],
                 "chunk": args.chunk_kb << 10}
            )  # fmt: skip
        naive_runs.append(trainer.read()["seconds"])
        naive_exact &= all(worker.read()["sha"] == model["sha"] for worker in used)
    naive_cpu = _cpu(used) - cpu_before
    naive = {"seconds": statistics.median(naive_runs)}
    # The median of the repeats: the machine is shared, and a neighbour's burst only ever adds time.
    hex_s = statistics.median(run["seconds"] for run in hex_runs)
    hex_off_s = statistics.median(run["seconds"] for run in runs[False])
    bound_s = model["nbytes"] / (args.cross_mb_per_s * 1e6)
    return {
        "replicas_per_pool": per_pool,
        "replica_count": len(used),
        "naive_s": round(naive["seconds"], 3),
        "hex_s": round(hex_s, 3),
        "hex_digest_off_s": round(hex_off_s, 3),
        "digest_on_over_off": round(hex_s / hex_off_s, 3),
        "hex_runs_s": [round(run["seconds"], 3) for run in hex_runs],
        "hex_digest_off_runs_s": [round(run["seconds"], 3) for run in runs[False]],
        "naive_runs_s": [round(seconds, 3) for seconds in naive_runs],
        "hex_phases_s": hex_runs[-1]["phases"],
        "bound_s": round(bound_s, 3),
        "hex_over_bound": round(hex_s / bound_s, 3),
        "naive_over_hex": round(naive["seconds"] / hex_s, 3),
        "hex_gb_per_s": round(model["nbytes"] / hex_s / 1e9, 4),
        "naive_gb_per_s": round(model["nbytes"] / naive["seconds"] / 1e9, 4),
        "bit_exact": bool(hex_exact and naive_exact),
        # CPU seconds a replica spends per update, digest on (mean over replicas and repeats): on a machine with
        # fewer cores than replicas, this is what stretches the update beyond the link bound.
        "replica_cpu_s": {
            "hex": round(hex_cpu / len(used) / args.repeats, 4),
            "naive": round(naive_cpu / len(used) / args.repeats, 4),
        },
        "hex_failed_replicas": sum(len(run["failed"]) for run in [*hex_runs, *runs[False]]),
    }


def _cpu(workers: list[Worker]) -> float:
    """CPU seconds the workers have used so far, together."""
    for worker in workers:
        worker.send({"t": "cpu"})
    return sum(worker.read()["cpu_s"] for worker in workers)


def _summarise(args, digest: dict, runs: list[dict], sender_runs: list[dict]) -> dict:
    done = [run for run in runs if "error" not in run]
    headline = next((run for run in done if run["replicas_per_pool"] == 3), done[-1] if done else {})
    ratios = [run["hex_over_bound"] for run in done]
    transport = digest["transport"]
    model_bytes = _model_bytes(args.hidden, args.layers, args.vocab)
    return {
        "links": "linux netns + veth + bridge + tbf (real kernel TCP, real gloo)",
        "pools": POOLS,
        "cross_gb_per_s": args.cross_mb_per_s / 1e3,
        "intra_gb_per_s": args.intra_mb_per_s / 1e3,
        "model": {
            "arch": "Qwen2ForCausalLM (random init, bf16)",
            "params": model_bytes // 2,
            "bytes": model_bytes,
        },
        "bucket_mb": args.bucket_mb,
        "chunk_kb": args.chunk_kb,
        "digest": {
            "algorithm": transport["algorithm"],
            "gb_per_core": transport["pool_gb_per_core"],
            "threads": transport["threads"],
            "cores_for_12.5_gb_per_s": transport["cores_for"]["100Gb/s"],
            "cores_for_50_gb_per_s": transport["cores_for"]["400Gb/s"],
            "candidates_gb_per_core": {name: a["gb_per_core"] for name, a in digest["algorithms"].items()},
        },
        **{key: headline.get(key) for key in ("replica_count", "naive_s", "hex_s", "bound_s", "bit_exact")},
        "gb_per_s": headline.get("hex_gb_per_s"),
        "by_replicas": {
            str(run["replicas_per_pool"]): {key: run.get(key) for key in _BY_REPLICAS if key in run}
            for run in runs
        },
        "by_senders": {
            str(run["senders"]): {key: run.get(key) for key in _BY_SENDERS if key in run}
            for run in sender_runs
        },
        "targets": {
            "hex_within_1.2x_bound_at_1_to_6_per_pool": bool(done)
            and all(
                "error" not in run and run["hex_over_bound"] <= 1.2
                for run in runs
                if run["replicas_per_pool"] <= 6
            ),
            "ratio_to_bound_spread": round(max(ratios) - min(ratios), 3) if ratios else None,
        },
        "failed_configurations": [run["error"] for run in [*runs, *sender_runs] if "error" in run],
        "runs": runs,
        "sender_runs": sender_runs,
    }


_BY_REPLICAS = (
    "hex_s",
    "hex_digest_off_s",
    "digest_on_over_off",
    "naive_s",
    "bound_s",
    "hex_over_bound",
    "error",
)
_BY_SENDERS = ("hex_s", "bound_s", "hex_over_bound", "replicas_per_pool", "bit_exact", "error")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="write the result here (also printed)")
    parser.add_argument(
        "--replicas",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 3, 6],
        help="replicas per pool, one configuration each (10 needs about 20 GiB free)",
    )
    parser.add_argument(
        "--senders",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[2, 4],
        help="numbers of training ranks that each send their part of a version ('' for none)",
    )
    parser.add_argument("--senders-replicas", type=int, default=3, help="replicas per pool for --senders")
    parser.add_argument("--cross-mb-per-s", type=float, default=30.0)
    parser.add_argument("--intra-mb-per-s", type=float, default=100.0)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", type=int, default=32)
    parser.add_argument("--chunk-kb", type=int, default=1024)
    parser.add_argument(
        "--repeats", type=int, default=3, help="transfers of each kind per configuration (median)"
    )
    parser.add_argument(
        "--digest-repeats", type=int, default=3, help="passes of benchmarks/digest.py (median)"
    )
    parser.add_argument("--digest-mb", type=int, default=256, help="the bucket benchmarks/digest.py hashes")
    parser.add_argument("--max-seconds", type=int, default=1200, help="hard limit for the whole run")
    parser.add_argument("--worker", choices=["trainer", "replica", "part"], help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--part", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--stage-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "trainer":
        trainer_worker(args)
        return 0
    if args.worker == "replica":
        replica_worker(args)
        return 0
    if args.worker == "part":
        part_worker(args)
        return 0
    _reclaim_staged()
    refusal = _check_memory(args)
    if refusal:
        print(refusal, file=sys.stderr)
        return 1
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print("needs root and iproute2 (ip, tc) for network namespaces; nothing was run", file=sys.stderr)
        return 1

    def stopped(signum, frame):
        raise TimeoutError(f"benchmark stopped by {signal.Signals(signum).name} (limit {args.max_seconds} s)")

    for signum in (signal.SIGALRM, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stopped)
    signal.alarm(args.max_seconds)
    workdir = Path(tempfile.mkdtemp(prefix="hex-transport-logs-"))
    staged = Path(tempfile.mkdtemp(prefix=f"{SHM_PREFIX}{os.getpid()}-", dir=SHM))
    try:
        result = _run(args, workdir, staged)
    except BaseException:
        print(f"benchmark failed; the workers' logs are kept in {workdir}", file=sys.stderr)
        raise
    finally:
        signal.alarm(0)
        shutil.rmtree(staged, ignore_errors=True)
    if result["failed_configurations"]:
        print(f"some configurations failed; the workers' logs are kept in {workdir}", file=sys.stderr)
    else:
        shutil.rmtree(workdir)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
