"""Each rollout server's decode speed at its running requests, as the online refit measures it
(``areal/refit_loop.py``).

SGLang launched with ``--enable-metrics`` serves Prometheus gauges at ``/metrics``: ``sglang:gen_throughput``
(decode tokens/s over its last logging interval), ``sglang:num_running_reqs`` and ``sglang:token_usage`` (the KV
pool's used fraction). A decode iteration gives each running request one token, so it takes running / tokens/s
seconds. Without them,
``/get_server_info`` gives ``internal_states[].last_gen_throughput`` (SGLang 0.4.4 on), and the running requests
are the ones the controller has in flight on that server. Upstream's ``RemoteSGLangEngine`` polls neither, and
the elastic watcher only ``/health``: a :class:`ServerPoller` thread reads every server a few times a step, and a
step's figure per server is the median of its busy readings (at least one request running).
"""

from __future__ import annotations

import math
import re
import statistics
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from areal.utils import logging

logger = logging.getLogger("HexRefit")

# Seconds between two readings of every server.
POLL_S = 1.0
TIMEOUT_S = 2.0
THROUGHPUT = "sglang:gen_throughput"
RUNNING = "sglang:num_running_reqs"
KV_USAGE = "sglang:token_usage"
# Gauges that are a fraction of one data-parallel rank's pool: the mean over the ranks, not the sum.
_FRACTIONS = {KV_USAGE}
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")


class ServerReading(NamedTuple):
    """One server's figures (None: not exposed): running requests, decode tokens/s, KV pool used fraction."""

    running: float | None
    tokens_per_s: float | None
    kv_usage: float | None = None

    @property
    def decode_iteration_s(self) -> float | None:
        """Seconds per decode iteration: each running request gains one token per iteration."""
        if self.running is None or not self.tokens_per_s:
            return None
        return self.running / self.tokens_per_s


def parse_metrics(text: str) -> dict[str, float]:
    """Each ``sglang:`` gauge of a Prometheus text page, summed over its series (one per data-parallel rank; a
    fraction of a rank's pool is their mean); a series of a tensor- or pipeline-parallel rank other than 0
    repeats rank 0's figure and is left out."""
    out: dict[str, float] = {}
    series: dict[str, int] = {}
    for line in text.splitlines():
        found = _SAMPLE.match(line)
        if not found or not found[1].startswith("sglang:"):
            continue
        labels = found[2] or ""
        if re.search(r'(tp_rank|pp_rank)="[1-9]', labels):
            continue
        try:
            value = float(found[3])
        except ValueError:
            continue
        if math.isfinite(value):
            out[found[1]] = out.get(found[1], 0.0) + value
            series[found[1]] = series.get(found[1], 0) + 1
    for name in _FRACTIONS & out.keys():
        out[name] /= series[name]
    return out


def read_server(address: str, timeout_s: float = TIMEOUT_S) -> ServerReading:
    """The figures of the server at ``host:port``; None for a figure it does not expose (or a server that does
    not answer)."""
    import requests

    try:
        answer = requests.get(f"http://{address}/metrics", timeout=timeout_s)
        if answer.status_code == 200:
            gauges = parse_metrics(answer.text)
            if THROUGHPUT in gauges:
                return ServerReading(gauges.get(RUNNING), gauges[THROUGHPUT], gauges.get(KV_USAGE))
        answer = requests.get(f"http://{address}/get_server_info", timeout=timeout_s)
        states = answer.json().get("internal_states") if answer.status_code == 200 else None
        rates = [
            s["last_gen_throughput"]
            for s in states or ()
            if isinstance(s, dict) and "last_gen_throughput" in s
        ]
        return ServerReading(None, float(sum(rates)) if rates else None)
    except (requests.RequestException, ValueError, TypeError):
        return ServerReading(None, None)


def _median(values) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


class ServerPoller:
    """Reads every server every ``interval_s`` on a thread of its own; :meth:`take` gives each server's medians
    of its busy readings since the last call."""

    def __init__(
        self,
        addresses: Callable[[], Sequence[str]],
        in_flight: Callable[[int], int],
        interval_s: float = POLL_S,
        read: Callable[[str, float], ServerReading] = read_server,
    ) -> None:
        self._addresses, self._in_flight, self._read = addresses, in_flight, read
        self.interval_s = interval_s
        self._readings: dict[int, list[ServerReading]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="hex-server-stats")

    def poll_once(self) -> None:
        """Read every server once."""
        addresses = list(self._addresses())
        answers = list(self._pool.map(lambda a: self._read(a, TIMEOUT_S), addresses))
        for rank, reading in enumerate(answers):
            rate = reading.tokens_per_s
            if rate is None:
                continue
            if reading.running is None:
                reading = reading._replace(running=float(self._in_flight(rank)))
            if reading.running >= 1 and math.isfinite(rate) and rate > 0:
                with self._lock:
                    self._readings.setdefault(rank, []).append(reading)

    def take(self) -> dict[int, ServerReading]:
        """Per server rank: the medians of its busy readings since the last call (servers with none are left
        out; a figure it never exposed is None)."""
        with self._lock:
            readings, self._readings = self._readings, {}
        return {
            rank: ServerReading(*map(_median, zip(*v, strict=True))) for rank, v in sorted(readings.items())
        }

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="hex-server-stats", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 2 * TIMEOUT_S)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll_once()
            except Exception as error:  # a measurement only: the run goes on
                logger.warning(f"cannot read the rollout servers' decode speed ({error})")
