"""Test parts for the transport: replica processes, a small real model, and a man-in-the-middle TCP proxy
that plays a slow or corrupting cross-pool link."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode
from areal_hex_plugin.transport.route import Endpoint
from areal_hex_plugin.transport.sinks import TensorParallelSink

TOKEN = b"test-token-0123456789abcdef"
_CTX = mp.get_context("fork")


def relay_digest(
    weights: dict[str, torch.Tensor],
    buckets: list[tuple[int, list[str]]],
    parts: int,
    version: int,
    update: str,
    token: bytes,
    chunk: int,
) -> str:
    """The relay's version digest recomputed from a copy of the weights, with the sender's token, nonce
    (``UpdateReport.update``), chunk size and number of parts, and its buckets (each bucket's version-wide index
    and its tensor names in packed order): equal to the sender's ``UpdateReport.digest`` exactly when the copy
    holds the bytes that were sent."""
    from areal_hex_plugin.transport.buckets import content_key, pack, part_digest, version_digest

    key = content_key(token, update)
    digests: list[list[str]] = [[] for _ in range(parts)]
    for index, names in sorted(buckets):  # part p's buckets are p, p + parts, ... (bucket_index)
        digests[index % parts].append(pack(index, [(n, weights[n]) for n in names], key, chunk).digest(key))
    return version_digest(key, version, [part_digest(key, p, d) for p, d in enumerate(digests)])


def small_qwen2(seed: int = 0, kv_heads: int = 4, layers: int = 2):
    """A randomly initialised Qwen2-architecture model (tiny), in bf16 like the rollout side expects."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).to(torch.bfloat16)


def small_qwen2_state_dict(seed: int = 0, layers: int = 2) -> dict[str, torch.Tensor]:
    model = small_qwen2(seed, layers=layers)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def in_buckets(state: dict[str, torch.Tensor], per_bucket: int) -> list[list[tuple[str, torch.Tensor]]]:
    items = list(state.items())
    return [items[i : i + per_bucket] for i in range(0, len(items), per_bucket)]


class _SavingSink(TensorParallelSink):
    """Writes every committed version to disk, so the test process can inspect it."""

    def __init__(self, tp_size: int, path: Path) -> None:
        super().__init__(tp_size)
        self.path = path

    def load(self, version, named_tensors) -> None:
        super().load(version, named_tensors)
        torch.save({"version": version, "shards": self.shards}, self.path)


def _replica_main(
    path: str,
    tp_size: int,
    timeout_s: float,
    ready,
    limits: dict[int, int],
    setup: Callable[[ReceiverNode], None] | None,
) -> None:
    # A forked replica inherits the test process's handlers (Ray's SIGTERM one, under xdist): terminate must end it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for limit, extra in limits.items():  # headroom above what this process uses already
        used = (
            len(os.listdir("/proc/self/fd"))
            if limit == resource.RLIMIT_NOFILE
            else _status_kb("VmSize") << 10
        )
        resource.setrlimit(limit, (used + extra, used + extra))
    stage = str(
        Path(path).with_suffix(".stage")
    )  # under the test's tmp_path: a terminated replica leaves no shm
    config = ReceiverConfig(timeout_s=timeout_s, stage_dir=stage)
    node = ReceiverNode(_SavingSink(tp_size, Path(path)), config, token=TOKEN)
    if setup is not None:  # e.g. turn this replica into an attacker
        setup(node)
    ready.put(node.start().port)
    threading.Event().wait()  # serve until the fleet terminates this process


def _status_kb(field: str, pid: str = "self") -> int:
    """A ``/proc/PID/status`` memory figure in kB (VmSize, VmHWM, VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def stop_process(pid: int, within_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped: the signal takes effect asynchronously, and on
    a loaded machine a thread already woken (by a commit arriving) ran on for milliseconds after ``kill`` returned."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + within_s
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                stat = (task / "stat").read_text()
                states.append(stat[stat.rfind(")") + 2])
        if all(state in "tTZX" for state in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} not stopped within {within_s} s (thread states {states})")
        time.sleep(0.005)


@dataclass
class Replica:
    process: mp.Process
    endpoint: Endpoint
    path: Path
    tp_size: int

    def peak_rss_mb(self) -> float:
        return _status_kb("VmHWM", str(self.process.pid)) / 1024

    def committed(self) -> dict:
        return torch.load(self.path) if self.path.exists() else {"version": -1, "shards": []}


class ReplicaFleet:
    """Replica processes, each a receiver node with a TP-sliced sink; terminated on exit."""

    def __init__(self, tmp_path: Path, timeout_s: float = 10.0) -> None:
        self.tmp_path, self.timeout_s = tmp_path, timeout_s
        self.replicas: list[Replica] = []

    def start(
        self,
        tp_sizes: list[int],
        limits: dict[int, int] | None = None,
        setup: Callable[[ReceiverNode], None] | None = None,
    ) -> list[Replica]:
        """``limits``: resource limits for the replica processes, as headroom above their use at start;
        ``setup``: called in each replica process with its node before it starts (forked: any callable)."""
        started = []
        for tp_size in tp_sizes:
            ready = _CTX.Queue()
            path = self.tmp_path / f"replica{len(self.replicas)}.pt"
            process = _CTX.Process(
                target=_replica_main, args=(str(path), tp_size, self.timeout_s, ready, limits or {}, setup)
            )
            process.start()
            replica = Replica(process, Endpoint("127.0.0.1", ready.get(timeout=60)), path, tp_size)
            self.replicas.append(replica)
            started.append(replica)
        return started

    def __enter__(self) -> ReplicaFleet:
        return self

    def __exit__(self, *exc) -> None:
        for replica in self.replicas:
            replica.process.terminate()
        for replica in self.replicas:
            replica.process.join(timeout=10)
            if replica.process.is_alive():
                replica.process.kill()
                replica.process.join()


class Proxy:
    """Forwards TCP to ``target``; can throttle the forward direction, flip one byte at ``corrupt_at``, or go
    silent (a dead link that never closes) once a connection has forwarded ``stall_after`` bytes. ``connections``
    lists every accepted connection as (client side, target side), in order; :meth:`cut` breaks one."""

    def __init__(
        self,
        target: Endpoint,
        bytes_per_s: float | None = None,
        corrupt_at: int | None = None,
        stall_after: int | None = None,
    ) -> None:
        self.target, self.bytes_per_s, self.corrupt_at, self.stall_after = (
            target,
            bytes_per_s,
            corrupt_at,
            stall_after,
        )
        self.corrupted = 0
        self.forwarded = 0  # bytes towards ``target``, all connections together
        self.stalled = threading.Event()
        self.connections: list[tuple[socket.socket, socket.socket]] = []
        self._closed = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = Endpoint("127.0.0.1", self._listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection((self.target.host, self.target.port))
            except (
                OSError
            ):  # the target is gone: its client sees the connection closed, and others may follow
                client.close()
                continue
            self.connections.append((client, server))
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, forward: bool) -> None:
        seen, started = 0, time.monotonic()
        try:
            while data := source.recv(1 << 16):
                if (
                    forward
                    and self.corrupt_at is not None
                    and not self.corrupted
                    and seen + len(data) > self.corrupt_at
                ):
                    data = bytearray(data)
                    data[self.corrupt_at - seen] ^= 0xFF
                    self.corrupted += 1
                seen += len(data)
                if forward and self.stall_after is not None and seen > self.stall_after:
                    self.stalled.set()
                    self._closed.wait()
                    return
                if forward and self.bytes_per_s:
                    time.sleep(max(0.0, started + seen / self.bytes_per_s - time.monotonic()))
                sink.sendall(data)
                if forward:
                    self.forwarded += len(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()

    def cut(self, index: int) -> None:
        """Break connection ``index`` both ways, as a failed link does (each end sees it closed)."""
        for end in self.connections[index]:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()


def transport_records(logger_name: str, monkeypatch, level: int = logging.WARNING) -> list[logging.LogRecord]:
    """What the transport's logger ``logger_name`` logs from now on at ``level`` and above: each transport module's
    logger of that name is swapped for one outside logging's registry, which upstream's logging set-up (dictConfig,
    disabling every logger it knows) cannot silence mid-test."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = records.append
    logger = logging.Logger(logger_name, level)
    logger.addHandler(handler)
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        own = getattr(module, "logger", None)
        if name.startswith("areal_hex_plugin.transport") and getattr(own, "name", None) == logger_name:
            monkeypatch.setattr(module, "logger", logger)
    return records
