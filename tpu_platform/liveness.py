# SPDX-License-Identifier: Apache-2.0
"""A liveness link between the hosts of data-parallel replicas (docs/multihost.md): a host that
dies ends the others, as a host of a multi-host mesh does through JAX's coordination service.

Replicas across hosts share no JAX job (no collective crosses replicas), and vLLM's front end
watches only its own host's engine processes. So host 0 listens on one TCP port beside vLLM's
data-parallel RPC port, every other host connects to it, and both ends of each connection send a
byte every `beat_seconds`. A connection that closes (a process killed: its kernel closes the
socket) or stays silent for `silence_seconds` (a machine gone without a word) is a lost peer:
`on_lost` runs once, with the reason. A connection only counts as a peer once it has sent the
greeting, so a stray connection (a port scan) ends nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import select
import socket
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(f"vllm_xla.{__name__}")

GREETING = b"vllm-xla data-parallel liveness link 1\n"
# Without --distributed-timeout-seconds: the bounds JAX keeps for a multi-host mesh's hosts.
DEFAULT_SILENCE_SECONDS = 100
DEFAULT_JOIN_SECONDS = 300
_BEAT = b"."


@dataclasses.dataclass(frozen=True, slots=True)
class LinkConfig:
    """Where host 0 listens, and how long a silent peer or a join may take."""

    address: str  # host 0's address (vLLM's --data-parallel-address)
    port: int
    silence_seconds: float  # a peer silent this long is taken for dead
    join_seconds: float  # how long another host retries reaching host 0
    beat_seconds: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"the liveness link's port must be in (0, 65536), got {self.port}")
        if self.beat_seconds <= 0 or self.silence_seconds <= 2 * self.beat_seconds:
            raise ValueError(
                f"a peer silent for {self.silence_seconds} s cannot be told from one beating every "
                f"{self.beat_seconds} s: the silence must be over twice the beat"
            )
        if self.join_seconds <= 0:
            raise ValueError(f"the liveness link's join timeout must be positive, got {self.join_seconds}")


def link_port(rpc_port: int) -> int:
    """The link's port: the one after vLLM's data-parallel RPC port (its handshake's)."""
    return rpc_port + 1


class _OnceOnly:
    """Runs the lost-peer callback at most once, however many connections fail together."""

    def __init__(self, on_lost: Callable[[str], None]) -> None:
        self._on_lost = on_lost
        self._fired = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, reason: str) -> None:
        with self._lock:
            if self._fired.is_set():
                return
            self._fired.set()
        logger.error("data-parallel liveness link: %s", reason)
        self._on_lost(reason)


def _beat_until_lost(conn: socket.socket, config: LinkConfig, peer: str, lost: Callable[[str], None]) -> None:
    """Sends a beat every `beat_seconds` and reads the peer's; returns once the peer is lost."""
    heard = time.monotonic()
    next_beat = heard
    while True:
        now = time.monotonic()
        if now - heard > config.silence_seconds:
            lost(f"{peer} was silent for {config.silence_seconds:g} s (--distributed-timeout-seconds)")
            return
        try:
            if now >= next_beat:
                conn.sendall(_BEAT)
                next_beat = now + config.beat_seconds
            readable, _, _ = select.select([conn], [], [], max(0.0, next_beat - time.monotonic()))
            if readable:
                if not conn.recv(4096):
                    lost(f"{peer} closed the link (its process ended)")
                    return
                heard = time.monotonic()
        except (ConnectionResetError, BrokenPipeError):
            # A process that ends with beats unread resets the connection rather than closing it.
            lost(f"{peer} closed the link (its process ended)")
            return
        except OSError as error:
            lost(f"{peer} is unreachable ({error})")
            return


def _read_greeting(conn: socket.socket, seconds: float) -> bool:
    conn.settimeout(seconds)
    received = b""
    try:
        while len(received) < len(GREETING):
            chunk = conn.recv(len(GREETING) - len(received))
            if not chunk:
                return False
            received += chunk
    except OSError:
        return False
    finally:
        conn.settimeout(None)
    return received == GREETING


class HeadLink:
    """Host 0's end: accepts the other hosts' connections and watches each until it is lost."""

    def __init__(self, config: LinkConfig, on_lost: Callable[[str], None]) -> None:
        self.config = config
        self._lost = _OnceOnly(on_lost)
        self._peers: set[socket.socket] = set()  # closed with the link
        self._closed = threading.Event()
        self._server = socket.create_server((config.address, config.port), reuse_port=False)
        threading.Thread(target=self._accept, name="dp-liveness-accept", daemon=True).start()
        logger.info(
            "data-parallel liveness link: listening at %s:%d; a host silent for %g s is taken for dead",
            config.address, config.port, config.silence_seconds,
        )  # fmt: skip

    def _accept(self) -> None:
        while True:
            try:
                conn, (host, port) = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._watch, args=(conn, f"the host at {host}:{port}"), daemon=True
            ).start()

    def _watch(self, conn: socket.socket, peer: str) -> None:
        self._peers.add(conn)
        with conn:
            if not _read_greeting(conn, self.config.silence_seconds):
                logger.warning("data-parallel liveness link: ignored %s (no greeting)", peer)
                return
            logger.info("data-parallel liveness link: %s joined", peer)
            _beat_until_lost(conn, self.config, peer, self._lost_unless_closed)

    def _lost_unless_closed(self, reason: str) -> None:
        if not self._closed.is_set():
            self._lost(reason)

    def close(self) -> None:
        """Stops listening and closes every peer's connection (they take host 0 for ended)."""
        self._closed.set()
        self._server.close()
        for conn in list(self._peers):
            conn.close()


def join_head(config: LinkConfig, on_lost: Callable[[str], None]) -> None:
    """Another host's end: on a thread, connects to host 0 (retrying for `join_seconds`; a host 0
    never reached is lost too, named with the fix) and watches the connection. The caller goes on
    starting (a configuration vLLM refuses is named at once, not after the join's timeout)."""
    lost = _OnceOnly(on_lost)
    threading.Thread(target=_join_and_beat, args=(config, lost), name="dp-liveness", daemon=True).start()


def _join_and_beat(config: LinkConfig, lost: _OnceOnly) -> None:
    deadline = time.monotonic() + config.join_seconds
    while True:
        try:
            conn = socket.create_connection((config.address, config.port), timeout=config.beat_seconds)
            break
        except OSError as error:
            if time.monotonic() >= deadline:
                lost(
                    f"could not reach host 0's data-parallel liveness link at {config.address}:"
                    f"{config.port} within {config.join_seconds:g} s ({error}): start host 0 with the "
                    "same --data-parallel-address and --data-parallel-rpc-port (the link listens on the "
                    "port after it), and let that port through between the hosts"
                )
                return
            time.sleep(config.beat_seconds)
    peer = f"host 0 at {config.address}:{config.port}"
    with conn:
        conn.settimeout(None)
        try:
            conn.sendall(GREETING)
        except OSError as error:
            lost(f"{peer} is unreachable ({error})")
            return
        logger.info("data-parallel liveness link: joined %s", peer)
        _beat_until_lost(conn, config, peer, lost)
