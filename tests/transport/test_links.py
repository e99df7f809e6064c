"""Data links on real sockets and real gloo groups: closing a link frees its group and rendezvous store."""

from __future__ import annotations

import os
import socket
import threading

import torch

from areal_hex_plugin.transport.links import DataLink, open_receiving_link, open_sending_link
from areal_hex_plugin.transport.wire import Channel

_CPU = torch.device("cpu")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _gloo_pair() -> tuple[DataLink, DataLink, Channel, Channel]:
    """Two ends of a gloo link whose rendezvous runs over a real channel (one key for both ends)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        upstream = Channel(socket.create_connection(listener.getsockname()), b"k" * 32, client=True)
        downstream = Channel(listener.accept()[0], b"k" * 32, client=False)
    opened: dict[str, DataLink] = {}
    receiver = threading.Thread(
        target=lambda: opened.setdefault("r", open_receiving_link(downstream, 10.0, _CPU))
    )
    receiver.start()
    sending = open_sending_link(upstream, "gloo", 10.0, _CPU)
    receiver.join()
    return sending, opened["r"], upstream, downstream


def _transfer(sending: DataLink, receiving: DataLink) -> None:
    chunk, got = (
        torch.arange(4096, dtype=torch.int32).view(torch.uint8),
        torch.empty(16384, dtype=torch.uint8),
    )
    receiver = threading.Thread(target=receiving.recv_into, args=(got,))
    receiver.start()
    sending.send(chunk)
    receiver.join()
    assert torch.equal(got, chunk)


def test_closed_gloo_links_hold_no_sockets_even_while_referenced():
    def one_version() -> tuple[DataLink, DataLink]:
        sending, receiving, upstream, downstream = _gloo_pair()
        _transfer(sending, receiving)
        for end in (sending, receiving, upstream, downstream):
            end.close()
        return sending, receiving

    one_version()  # gloo's first group opens process-wide resources once
    before = _open_fds()
    kept = [one_version() for _ in range(4)]  # e.g. a report or a forwarder still holding its link
    assert len(kept) == 4 and _open_fds() <= before
