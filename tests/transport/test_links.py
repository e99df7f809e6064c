"""Data links on real sockets and real gloo groups: closing a link frees its group and rendezvous store."""

from __future__ import annotations

import datetime
import os
import socket
import threading

import pytest
import torch

from areal_hex_plugin.transport.links import DataLink, TorchLink
from areal_hex_plugin.transport.wire import Channel

_CPU = torch.device("cpu")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _gloo_pair() -> tuple[TorchLink, TorchLink]:
    """Two ends of a real two-rank gloo group on the CPU: the group :class:`TorchLink` drives as it drives NCCL's on
    a GPU (a ``gloo`` data link itself carries its bytes on the authenticated connection)."""
    store, links = torch.distributed.HashStore(), [None, None]

    def make(rank: int) -> None:
        options = torch.distributed.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=10)
        options._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        links[rank] = TorchLink(torch.distributed.ProcessGroupGloo(store, rank, 2, options), rank, _CPU)

    made = [threading.Thread(target=make, args=(rank,)) for rank in (0, 1)]
    for thread in made:
        thread.start()
    for thread in made:
        thread.join()
    return links[0], links[1]


def _transfer(sending: DataLink, receiving: DataLink) -> None:
    chunk, got = (
        torch.arange(4096, dtype=torch.int32).view(torch.uint8),
        torch.empty(16384, dtype=torch.uint8),
    )
    receiver = threading.Thread(target=lambda: list(receiving.receive([got])))
    receiver.start()
    sending.send(chunk)
    receiver.join()
    assert torch.equal(got, chunk)


def test_closed_gloo_links_hold_no_sockets_even_while_referenced():
    def one_version() -> tuple[DataLink, DataLink]:
        sending, receiving = _gloo_pair()
        _transfer(sending, receiving)
        for end in (sending, receiving):
            end.close()
        return sending, receiving

    one_version()  # gloo's first group opens process-wide resources once
    before = _open_fds()
    kept = [one_version() for _ in range(4)]  # e.g. a report or a forwarder still holding its link
    assert len(kept) == 4 and _open_fds() <= before


class _Recorded:
    """A real gloo group that notes each send and recv as it is posted."""

    def __init__(self, group, log: list[str]) -> None:
        self.group, self.log = group, log

    def send(self, tensors, peer, tag):
        self.log.append(f"send {tensors[0].numel()}")
        return self.group.send(tensors, peer, tag)

    def recv(self, tensors, peer, tag):
        self.log.append(f"recv {tensors[0].numel()}")
        return self.group.recv(tensors, peer, tag)

    def shutdown(self) -> None:
        self.group.shutdown()


@pytest.mark.parametrize("staged", [True, False])
def test_link_posts_the_next_transfer_before_handing_out_a_chunk(staged):
    """Over a real gloo pair, the direct path (gloo on the CPU) and the double-buffered one a GPU link takes
    (``staged``): bytes exact across chunk sizes that grow and shrink (buffers are reused in turn), and chunk k+1's
    receive is posted before chunk k is handed to the caller."""
    sending, receiving = _gloo_pair()
    log: list[str] = []
    ends = [TorchLink(_Recorded(link.group, log), link.rank, _CPU, staged) for link in (sending, receiving)]
    sizes = [100, 4096, 4096, 7, 8192, 4096]
    chunks = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    got = [torch.empty(n, dtype=torch.uint8) for n in sizes]

    def receive() -> None:
        for index, piece in enumerate(ends[1].receive(got)):
            assert piece is got[index]
            log.append(f"got {index}")

    receiver = threading.Thread(target=receive)
    receiver.start()
    for chunk in chunks:
        ends[0].send(chunk)
    ends[0].flush()
    receiver.join(20)
    try:
        assert all(torch.equal(a, b) for a, b in zip(got, chunks, strict=True))
        received = [entry for entry in log if not entry.startswith("send")]
        posted = [at for at, entry in enumerate(received) if entry.startswith("recv")]
        assert [received[at] for at in posted] == [f"recv {n}" for n in sizes]
        assert all(posted[k + 1] < received.index(f"got {k}") for k in range(len(sizes) - 1))
    finally:
        for end in ends:
            end.close()


def test_a_staged_receiver_reuses_its_host_staging_from_one_version_to_the_next():
    """The receiving side copies each chunk off the device through two host buffers (pinned where CUDA is), kept
    with the link: a later version of chunks no larger reuses them, a larger chunk grows them; bytes exact."""
    sending, receiving = _gloo_pair()
    ends = [TorchLink(link.group, link.rank, _CPU, staged=True) for link in (sending, receiving)]

    def version(sizes: list[int]) -> list[int]:
        chunks = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
        got = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        receiver = threading.Thread(target=lambda: list(ends[1].receive(got)))
        receiver.start()
        for chunk in chunks:
            ends[0].send(chunk)
        ends[0].flush()
        receiver.join(20)
        assert all(torch.equal(a, b) for a, b in zip(got, chunks, strict=True))
        return [buffer.data_ptr() for buffer in ends[1]._host]

    try:
        first = version([4096, 4096, 1000])
        assert all(buffer.is_pinned() == torch.cuda.is_available() for buffer in ends[1]._host)
        assert version([4096, 100, 4096]) == first
        assert version([8192, 8192])[0] != first[0]
    finally:
        for end in ends:
            end.close()


def test_rendezvous_stores_answer_every_call_c10d_makes():
    """NCCL's group calls compare_set, add and check on its store, through c10d's C++ trampoline (a store without
    them fails the first send with INTERNAL ASSERT "Not implemented", as on an H200 with torch 2.11); a
    PrefixStore calls them through the same trampoline, on both ends of a real channel."""
    from areal_hex_plugin.transport.links import _ChannelStore, _ServedStore

    with socket.create_server(("127.0.0.1", 0)) as listener:
        upstream = Channel(socket.create_connection(listener.getsockname()), b"k" * 32, client=True)
        downstream = Channel(listener.accept()[0], b"k" * 32, client=False)
    served = _ServedStore(5.0)
    server = threading.Thread(target=served.serve, args=(downstream,))
    server.start()
    asking = _ChannelStore(upstream)
    for store in (asking, served):
        view = torch.distributed.PrefixStore(f"p{id(store)}", store)
        assert view.compare_set("cas", "", "first") == b"first"  # missing and expected empty: set
        assert view.compare_set("cas", "other", "second") == b"first"  # no match: unchanged
        assert view.compare_set("cas", "first", "third") == b"third"
        assert view.add("count", 2) == 2 and view.add("count", 3) == 5
        assert view.check(["cas", "count"]) and not view.check(["never set"])
        view.set("plain", b"v")
        assert view.get("plain") == b"v"
    asking.close()
    server.join(5)
    assert not server.is_alive()
    assert not asking.check(["cas"])  # after the rendezvous: answered here, nothing sent on the channel
    with pytest.raises(Exception, match="after the rendezvous"):
        asking.get("cas")
    upstream.close()
    downstream.close()
