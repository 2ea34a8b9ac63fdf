"""A userspace TCP proxy that shapes one client's link: latency, jitter, outages and rate.

Every byte that crosses the proxy is delayed as on a real access link: it first waits for the
bottleneck (serialisation at ``bandwidth_mbps``, shared by all connections of the link, when the
proxy shapes the rate itself), then travels one way in ``rtt_ms / 2`` plus a half-normal jitter.
Delivery times never decrease within a connection, so TCP's byte order is kept.

Outages follow a two-state on/off chain with exponential sojourn times (seeded). Under the
``"fail"`` policy going offline aborts every open connection (a reset, as when a phone loses its
radio bearer) and refuses new ones until the link is back, which is what a SuperNode sees on an
intermittent link; under ``"resume"`` the bytes wait and the connections survive (a stall).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import random
import threading
import time
from dataclasses import dataclass, field

from .errors import LinkError
from .presets import LinkSpec

_CHUNK_BYTES = 64 * 1024
# Bounded per-direction queues give backpressure: the sender cannot run far ahead of the link.
_QUEUE_CHUNKS = 32


@dataclass
class ProxyStats:
    """Counters of one proxy (read them after ``stop`` or accept small races while running)."""

    connections: int = 0
    refused_offline: int = 0
    aborted_by_outage: int = 0
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    outages: int = 0
    offline_intervals_s: list[tuple[float, float]] = field(default_factory=list)


class _Direction:
    """The bottleneck of one direction of the link, shared by its connections."""

    def __init__(self, bandwidth_mbps: float | None) -> None:
        self.bytes_per_s = None if bandwidth_mbps is None else bandwidth_mbps * 1e6 / 8.0
        self.next_free_s = 0.0

    def departure_s(self, arrival_s: float, nbytes: int) -> float:
        if self.bytes_per_s is None:
            return arrival_s
        start_s = max(arrival_s, self.next_free_s)
        self.next_free_s = start_s + nbytes / self.bytes_per_s
        return self.next_free_s


class LinkProxy:
    """Forward ``listen_host:listen_port`` to ``target_host:target_port`` through a shaped link.

    Parameters
    ----------
    spec : LinkSpec
        The link: ``rtt_ms``, ``jitter_ms``, rates, and the on/off chain.
    target_host, target_port : str, int
        Where connections are forwarded (the SuperLink, or a calibration sink).
    listen_host : str
        Address to listen on: loopback, or the host end of a veth pair.
    listen_port : int
        0 picks a free port (see :attr:`port` after :meth:`start`).
    shape_rate : bool
        Shape bandwidth here (True), or leave it to the kernel (``tbf``/``netem``) and only add
        delay and outages (False).
    shape_delay : bool
        Add latency and jitter here (False when ``netem`` already does).
    outages : bool
        Run the on/off chain of ``spec`` (only when the link is intermittent).
    seed : int
        Seeds the jitter and the outage chain.
    """

    def __init__(
        self,
        spec: LinkSpec,
        target_host: str,
        target_port: int,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        shape_rate: bool = True,
        shape_delay: bool = True,
        outages: bool = True,
        seed: int = 0,
    ) -> None:
        self.spec = spec
        self.target = (target_host, target_port)
        self.listen_host = listen_host
        self._listen_port = listen_port
        self.shape_delay = shape_delay
        self.run_outages = outages and spec.intermittent
        self._rng = random.Random(seed)
        self._up = _Direction(spec.up_mbps if shape_rate else None)
        self._down = _Direction(spec.down_mbps if shape_rate else None)
        self.stats = ProxyStats()
        self._online = True
        self._online_event: asyncio.Event | None = None
        self._offline_since: float | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The port the proxy listens on."""
        if self._server is None:
            raise LinkError("proxy not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def address(self) -> str:
        """``host:port`` a client dials."""
        return f"{self.listen_host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> LinkProxy:
        """Start the proxy's event loop in a daemon thread and bind the listening socket."""
        self._thread = threading.Thread(target=self._run, name=f"proxy-{self.spec.name}",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise LinkError(f"proxy on {self.listen_host} did not start within {timeout_s} s")
        if self._start_error is not None:
            raise LinkError(
                f"proxy could not listen on {self.listen_host}:{self._listen_port}: "
                f"{self._start_error}"
            ) from self._start_error
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the listener and every connection, and join the thread (idempotent)."""
        if self._loop is None or self._thread is None:
            return
        with contextlib.suppress(RuntimeError, TimeoutError, concurrent.futures.TimeoutError):
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout_s)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        self._thread = None

    async def _shutdown(self) -> None:
        assert self._server is not None and self._loop is not None
        self._server.close()
        # Aborting the transports ends every connection's pumps by themselves; cancelling the
        # handler tasks instead trips asyncio's stream callback on Python 3.11.
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        current = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not current]
        if pending:
            await asyncio.wait(pending, timeout=2.0)

    def __enter__(self) -> LinkProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._handle, self.listen_host, self._listen_port)
            )
        except OSError as err:
            self._start_error = err
            self._ready.set()
            loop.close()
            return
        self._online_event = asyncio.Event()
        self._online_event.set()
        if self.run_outages:
            self._spawn(self._outage_chain())
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    def _spawn(self, coro: object) -> None:
        assert self._loop is not None
        task = self._loop.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- outages ---------------------------------------------------------------------------
    def set_online(self, online: bool) -> None:
        """Force the link up or down from any thread (going down drops every connection)."""
        if self._loop is None:
            raise LinkError("proxy not started")
        self._loop.call_soon_threadsafe(self._set_online, online)

    def _set_online(self, online: bool) -> None:
        if online == self._online:
            return
        now = time.monotonic()
        self._online = online
        assert self._online_event is not None
        if online:
            self._online_event.set()
        else:
            self._online_event.clear()
        if online:
            assert self._offline_since is not None
            self.stats.offline_intervals_s.append((self._offline_since, now))
            self._offline_since = None
            return
        self._offline_since = now
        self.stats.outages += 1
        if self.spec.outage_policy == "resume":
            return  # bytes wait in the pumps until the link is back
        for writer in list(self._writers):
            self.stats.aborted_by_outage += 1
            writer.transport.abort()

    async def _outage_chain(self) -> None:
        while True:
            await asyncio.sleep(self._rng.expovariate(1.0 / self.spec.mean_online_s))
            self._set_online(False)
            await asyncio.sleep(self._rng.expovariate(1.0 / self.spec.mean_offline_s))
            self._set_online(True)

    # ---- forwarding ------------------------------------------------------------------------
    def _one_way_delay_s(self) -> float:
        if not self.shape_delay:
            return 0.0
        # Each direction carries half the round trip and half its jitter, so that a request and
        # its reply see ``rtt_ms +- jitter_ms`` as in the emulator.
        half_jitter_ms = self.spec.jitter_ms / 2.0
        jitter_ms = self._rng.uniform(-half_jitter_ms, half_jitter_ms) if half_jitter_ms else 0.0
        return max(0.0, self.spec.rtt_ms / 2.0 + jitter_ms) / 1000.0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._online and self.spec.outage_policy == "fail":
            self.stats.refused_offline += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.stats.connections += 1
        self._writers.update((writer, up_writer))
        try:
            await asyncio.gather(
                self._pump(reader, up_writer, self._up, "uplink_bytes"),
                self._pump(up_reader, writer, self._down, "downlink_bytes"),
                return_exceptions=True,
            )
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        direction: _Direction,
        counter: str,
    ) -> None:
        queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue(_QUEUE_CHUNKS)
        loop = asyncio.get_running_loop()

        async def read_side() -> None:
            try:
                await _read_loop()
            except OSError:
                # The peer reset: pass the reset on (``None``) rather than a clean end of stream.
                await queue.put((loop.time(), None))

        async def _read_loop() -> None:
            last_deliver_s = 0.0
            while True:
                data = await reader.read(_CHUNK_BYTES)
                now = loop.time()
                if not data:
                    await queue.put((max(now, last_deliver_s), b""))
                    return
                departure_s = direction.departure_s(now, len(data))
                last_deliver_s = max(last_deliver_s, departure_s + self._one_way_delay_s())
                await queue.put((last_deliver_s, data))

        async def write_side() -> None:
            while True:
                deliver_s, data = await queue.get()
                wait_s = deliver_s - loop.time()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                assert self._online_event is not None
                await self._online_event.wait()  # a stall under the "resume" policy
                if data is None:
                    writer.transport.abort()
                    return
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
                setattr(self.stats, counter, getattr(self.stats, counter) + len(data))

        reading = asyncio.ensure_future(read_side())
        try:
            await write_side()
        except OSError:
            pass  # the other end reset, or an outage aborted the connection
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
