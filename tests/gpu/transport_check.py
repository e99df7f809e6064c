"""GPU check for the weight transport (run_all.sh runs it; not collected by pytest). Needs only torch with CUDA
and numpy, and this repository (it imports torch and ``areal_hex_plugin.transport``: no areal, no sglang, no
network):

    PYTHONPATH=$PWD python tests/gpu/transport_check.py --json transport_gpu.json [--gb 2]

* ``nccl``: the real NCCL code path. The trainer holds a bf16 state dict on cuda:0 and sends it over NCCL pair
  groups to a relay chain of receivers, each its own process: on cuda:1.. with 2+ GPUs (with 3 or more they form
  two pools), and on cuda:0 itself on a one-GPU machine. NCCL refuses two ranks of one communicator on one GPU of
  one host, so there every process gets its own ``NCCL_HOSTID``: NCCL then sees two hosts and moves the bytes
  over its network transport (sockets on the loopback interface unless ``NCCL_SOCKET_IFNAME``/``NCCL_IB_DISABLE``
  say otherwise), through the same pair groups, chunking and digests as across machines.
* ``nccl_link``: one NCCL data link between cuda:0 and cuda:1 (cuda:0 twice on one GPU), opened as the nodes open it (rendezvous
  over an authenticated channel): host-to-host throughput of its double-buffered path (pinned host memory on
  the sending side as the sender packs it, pageable memory on the receiving side as a relay stages it, reached
  through the link's own pinned staging buffers; each chunk's host copy overlaps the next chunk's transfer on the
  link's own CUDA stream) next to the same group's device-to-device throughput, which bounds it; bytes checked.
  The host-to-host transfer runs twice, as two versions over a kept link: ``pinned_staging`` is true when the
  receiver's staging buffers are pinned and the second transfer reused them.
* ``gloo`` and ``tcp``: the same transfer from GPU-resident tensors (bucket packing copies device to host), which
  also runs on a single GPU.
* ``gloo_2_senders`` and ``nccl_2_senders``: the version in two parts, as two training ranks send it (the
  coordinating ``RelaySender`` and a ``PartSender``, each packing its own GPU-resident buckets).

Each receiver hashes what it committed; ``bit_exact`` compares with the trainer's hash. Prints and writes JSON;
exit 0 when every transfer was bit-exact, 1 otherwise (an entry that raised carries its ``error``), 2 without CUDA.
``--cpu`` runs only ``gloo_2_senders``, from CPU tensors (CI runs this script so; it proves nothing about GPUs).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import multiprocessing as mp
import os
import queue
import secrets
import socket
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from areal_hex_plugin.transport.links import open_receiving_link, open_sending_link  # noqa: E402
from areal_hex_plugin.transport.node import ReceiverConfig, ReceiverNode  # noqa: E402
from areal_hex_plugin.transport.route import Endpoint, PoolRoute, Route  # noqa: E402
from areal_hex_plugin.transport.sender import PartSender, RelaySender, SenderConfig  # noqa: E402
from areal_hex_plugin.transport.wire import Channel  # noqa: E402


def _sha(named_tensors) -> str:
    digest = hashlib.sha256()
    for name, tensor in named_tensors:
        digest.update(name.encode())
        digest.update(memoryview(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


class _HashSink:
    def __init__(self, results, label: str) -> None:
        self.results, self.label = results, label

    def load(self, version, named_tensors) -> None:
        self.results.put((self.label, version, _sha(named_tensors)))


# A process's NCCL host identity, set before its first NCCL call where processes share a GPU (see the docstring).
HOSTID = "NCCL_HOSTID"


def _share_gpu(label: str | None) -> None:
    if label is not None:
        os.environ[HOSTID] = f"hex-transport-check-{label}"


def _receiver(device: int | None, label: str, ready, results, token: str, hostid: str | None) -> None:
    os.environ["AREAL_HEX_TRANSPORT_TOKEN"] = token
    _share_gpu(hostid)
    if device is not None:
        torch.cuda.set_device(device)
    node = ReceiverNode(_HashSink(results, label), ReceiverConfig(timeout_s=120.0))
    ready.put((label, node.start().port))
    time.sleep(3600)


def _state(gigabytes: float, device: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    count = max(1, int(gigabytes * 1e9 / (4096 * 4096 * 2)))
    return {
        f"model.layers.{i}.mlp.up_proj.weight": torch.randn(4096, 4096, device=device).bfloat16()
        for i in range(count)
    }


def _send(sender: RelaySender, version: int, buckets: list, parts: int):
    """One version, from ``parts`` senders in this process (bucket i from part i % parts), repairs included."""
    if parts == 1:
        return sender.send_version(version, buckets)
    sender.begin(version)
    others = [PartSender(sender.assignment(), part) for part in range(1, parts)]
    for i, bucket in enumerate(buckets):
        (sender if i % parts == 0 else others[i % parts - 1]).send_bucket(bucket)
    summaries = [other.finish() for other in others]
    while (plan := sender.settle(summaries)) is not None:
        summaries = [other.repair(plan) for other in others]
    try:
        return sender.finish(parts=summaries)
    finally:
        for other in others:
            other.close()


def _run(
    backend: str, devices: list[int | None], state, reference: str, token: str, parts: int = 1, shared=False
) -> dict:
    """``shared``: the receivers share the trainer's GPU (each gets its own NCCL host identity)."""
    context = mp.get_context("spawn")
    ready, results = context.Queue(), context.Queue()
    labels = [f"r{i}" for i in range(len(devices))]
    processes = [
        context.Process(
            target=_receiver,
            args=(device, label, ready, results, token, label if shared else None),
            daemon=True,
        )
        for device, label in zip(devices, labels, strict=True)
    ]
    for process in processes:
        process.start()
    try:
        ports = dict(ready.get(timeout=120) for _ in processes)
        endpoints = [Endpoint("127.0.0.1", ports[label]) for label in labels]
        half = (len(endpoints) + 1) // 2 if len(endpoints) > 2 else len(endpoints)
        pools = [PoolRoute("a", endpoints[:half], 1.5, 5.0)]
        if endpoints[half:]:
            pools.append(PoolRoute("b", endpoints[half:], 1.5, 5.0))
        items = list(state.items())
        buckets = [items[i : i + 8] for i in range(0, len(items), 8)]
        config = SenderConfig(backend=backend, timeout_s=120.0, chunk_bytes=64 << 20)
        sender = RelaySender(Route(pools), config, parts=parts)
        runs = []
        for version in (1, 2):
            report = _send(sender, version, buckets, parts)
            runs.append({"seconds": round(report.seconds, 3), "phases": report.phases})
        sender.close()
        hashes = [results.get(timeout=120) for _ in range(2 * len(processes))]
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        return {
            "senders": parts,
            "receivers": len(processes),
            "pools": len(pools),
            "bytes": nbytes,
            "runs": runs,
            "gb_per_s": round(nbytes / runs[-1]["seconds"] / 1e9, 3),
            "bit_exact": all(sha == reference for _, _, sha in hashes),
        }
    finally:
        for process in processes:
            process.kill()
            process.join()


def _link_end(rank: int, ports, results, chunks: int, chunk_bytes: int, gpus: int) -> None:
    """One end of an NCCL data link on cuda:<rank> (cuda:0 for both on one GPU); rank 0 sends, rank 1 receives and
    reports."""
    _share_gpu(f"link{rank}" if gpus == 1 else None)
    device = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(device)
    if rank == 1:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            ports.put(listener.getsockname()[1])
            channel = Channel(listener.accept()[0], b"k" * 32, client=False)
        link = open_receiving_link(channel, 120.0, device)
    else:
        channel = Channel(
            socket.create_connection(("127.0.0.1", ports.get(timeout=120))), b"k" * 32, client=True
        )
        link = open_sending_link(channel, "nccl", 120.0, device)
    torch.manual_seed(1)
    data = torch.randint(0, 256, (chunks * chunk_bytes,), dtype=torch.uint8)
    # The sender's host memory is pinned as it packs buckets on a GPU machine; a relay's staged file is pageable.
    data = data.pin_memory() if rank == 0 else torch.zeros_like(data)
    pieces = [data[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(chunks)]
    on_device = torch.empty(chunk_bytes, dtype=torch.uint8, device=device)
    timings, staging = {}, []
    for mode in ("device_to_device", "host_to_host", "host_to_host_again"):
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        if mode == "device_to_device":
            for _ in range(chunks):
                op = link.group.send if rank == 0 else link.group.recv
                op([on_device], 1 - rank, 7).wait()
            torch.cuda.synchronize(device)
        elif rank == 0:
            for piece in pieces:
                link.send(piece)
            link.flush()
        else:
            for _ in link.receive(pieces):
                pass
            staging.append([(buffer.data_ptr(), buffer.is_pinned()) for buffer in link._host])
        timings[mode] = time.perf_counter() - began
    if rank == 1:
        torch.manual_seed(1)
        expected = torch.randint(0, 256, (chunks * chunk_bytes,), dtype=torch.uint8)
        pinned = staging[0] == staging[1] and all(is_pinned for _, is_pinned in staging[0])
        results.put((timings, torch.equal(data, expected), pinned))
    link.close()
    channel.close()


def _result_of(results, processes, timeout_s: float = 300.0):
    """The first result on ``results``; an error as soon as one of ``processes`` died without giving it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=2)
        except queue.Empty:
            dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a link end exited with code {dead[0]} (its stderr says why)") from None
    raise TimeoutError(f"no result within {timeout_s:.0f} s")


def _nccl_link(gigabytes: float, gpus: int) -> dict:
    chunk_bytes = 64 << 20
    chunks = max(4, int(gigabytes * 1e9 // chunk_bytes))
    context = mp.get_context("spawn")
    ports, results = context.Queue(), context.Queue()
    ends = [
        context.Process(target=_link_end, args=(rank, ports, results, chunks, chunk_bytes, gpus), daemon=True)
        for rank in (1, 0)
    ]
    for end in ends:
        end.start()
    try:
        timings, exact, pinned = _result_of(results, ends)
    finally:
        for end in ends:
            end.join(timeout=30)
            end.kill()
    nbytes = chunks * chunk_bytes
    speeds = {f"{mode}_gb_per_s": round(nbytes / seconds / 1e9, 2) for mode, seconds in timings.items()}
    return {
        "bytes": nbytes,
        "chunk_bytes": chunk_bytes,
        **speeds,
        "bit_exact": exact,
        "pinned_staging": pinned,
    }


def _entry(name: str, run) -> dict:
    """One entry's result, or the error it raised (the other entries still run); printed as it ends, so a log
    cut short by a timeout still holds the entries that finished."""
    try:
        entry = run()
    except Exception as error:  # noqa: BLE001 - reported in the JSON, and the check fails
        entry = {"error": f"{type(error).__name__}: {error}", "bit_exact": False}
    print(f"[transport_check] {name}: {json.dumps(entry)}", file=sys.stderr, flush=True)
    return entry


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--gb", type=float, default=2.0, help="state dict size")
    parser.add_argument(
        "--cpu", action="store_true", help="gloo_2_senders only, from CPU tensors (no CUDA needed)"
    )
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (--cpu runs the CPU entry)", file=sys.stderr)
        return 2
    if importlib.util.find_spec("numpy") is None:
        print("needs numpy (the transport reads tensor bytes through tensor.numpy()): pip install numpy")
        return 2
    token = secrets.token_hex(16)
    os.environ["AREAL_HEX_TRANSPORT_TOKEN"] = token
    gpus = 0 if args.cpu else torch.cuda.device_count()
    result = {
        "gpus": gpus,
        "gpu": torch.cuda.get_device_name(0) if gpus else None,
        "torch": torch.__version__,
    }
    if (
        gpus == 1
    ):  # receivers and links share the one GPU: every process its own NCCL host (see the docstring)
        _share_gpu("trainer")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")
        result["nccl_env"] = {k: os.environ[k] for k in ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE")}
    state = _state(args.gb, "cuda:0" if gpus else "cpu")
    reference = _sha(state.items())
    if gpus:
        receivers = list(range(1, gpus)) if gpus >= 2 else [0, 0]
        shared = gpus == 1
        result["nccl"] = _entry(
            "nccl", lambda: _run("nccl", receivers, state, reference, token, shared=shared)
        )
        result["nccl_link"] = _entry("nccl_link", lambda: _nccl_link(args.gb, gpus))
        result["nccl_2_senders"] = _entry(
            "nccl_2_senders", lambda: _run("nccl", receivers, state, reference, token, parts=2, shared=shared)
        )
    for backend in ("gloo", "tcp") if gpus else ():
        result[backend] = _entry(
            backend, lambda backend=backend: _run(backend, [None, None, None], state, reference, token)
        )
    result["gloo_2_senders"] = _entry(
        "gloo_2_senders", lambda: _run("gloo", [None, None, None], state, reference, token, parts=2)
    )
    ok = all(
        entry.get("bit_exact", True) and entry.get("pinned_staging", True)
        for entry in result.values()
        if isinstance(entry, dict) and "bit_exact" in entry
    )
    result["ok"] = ok
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
