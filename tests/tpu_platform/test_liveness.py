# SPDX-License-Identifier: Apache-2.0
"""The data-parallel hosts' liveness link, in this process over localhost: host 0's end and
another host's end each notice the other's process ending (the socket closed) and its silence
(the socket open, no beats), a stray connection ends nothing, and a host 0 that never listens is
named within the join timeout. The served proof (two hosts' replicas) is test_data_parallel_hosts.
"""

from __future__ import annotations

import queue
import socket
import time

import pytest

from tests.plugin_shim.multihost_launch import free_port
from tpu_platform.liveness import GREETING, HeadLink, LinkConfig, join_head, link_port

BEAT_S = 0.05
SILENCE_S = 0.5


def _config(port: int, join_seconds: float = 5.0) -> LinkConfig:
    return LinkConfig(
        "127.0.0.1", port, silence_seconds=SILENCE_S, join_seconds=join_seconds, beat_seconds=BEAT_S
    )


def _wait(lost: queue.Queue, seconds: float) -> tuple[str, float]:
    start = time.monotonic()
    reason = lost.get(timeout=seconds)
    return reason, time.monotonic() - start


@pytest.fixture
def head():
    lost: queue.Queue = queue.Queue()
    link = HeadLink(_config(free_port()), lost.put)
    yield link, lost
    link.close()


def test_joined_hosts_beat_and_host_0_notices_one_whose_process_ended(head):
    link, lost = head
    other: queue.Queue = queue.Queue()
    join_head(link.config, other.put)
    time.sleep(2 * SILENCE_S)  # beats flow both ways: nobody is taken for dead
    assert lost.empty() and other.empty()
    conn = socket.create_connection((link.config.address, link.config.port))
    conn.sendall(GREETING)
    time.sleep(5 * BEAT_S)
    conn.close()  # what the kernel does for a killed process (host 0's beats unread: a reset)
    reason, seconds = _wait(lost, 5)
    assert "closed the link" in reason and seconds < SILENCE_S


@pytest.mark.parametrize("host_0", ["ends", "falls_silent"])
def test_another_host_notices_host_0_ending_or_falling_silent(host_0):
    """Host 0 here is a bare listener: it accepts the link and either closes it (its process
    ended) or keeps it open without a beat (a machine gone without closing anything)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        lost: queue.Queue = queue.Queue()
        join_head(_config(server.getsockname()[1]), lost.put)
        conn, _ = server.accept()
        assert conn.recv(len(GREETING)) == GREETING
        if host_0 == "ends":
            conn.close()
        reason, seconds = _wait(lost, 5)
        conn.close()
    if host_0 == "ends":
        assert "host 0 at 127.0.0.1" in reason and "closed the link" in reason and seconds < SILENCE_S
    else:
        assert f"silent for {SILENCE_S:g} s" in reason and seconds < SILENCE_S + 2


def test_a_silent_host_is_taken_for_dead_by_host_0(head):
    link, lost = head
    conn = socket.create_connection((link.config.address, link.config.port))
    conn.sendall(GREETING)  # joins, then never beats
    reason, seconds = _wait(lost, 5)
    assert f"silent for {SILENCE_S:g} s" in reason and seconds >= SILENCE_S - 0.1
    conn.close()


def test_a_stray_connection_ends_nothing(head):
    link, lost = head
    with socket.create_connection((link.config.address, link.config.port)) as conn:
        conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
    time.sleep(SILENCE_S + 0.5)
    assert lost.empty()


def test_a_host_0_that_never_listens_is_named_within_the_join_timeout():
    port = free_port()
    lost: queue.Queue = queue.Queue()
    start = time.monotonic()  # before the join starts its own clock, so that it cannot read short
    join_head(_config(port, join_seconds=0.3), lost.put)
    reason = lost.get(timeout=5)
    seconds = time.monotonic() - start
    assert f"host 0's data-parallel liveness link at 127.0.0.1:{port} within 0.3 s" in reason
    assert 0.3 <= seconds < 3


def test_the_link_checks_its_numbers():
    assert link_port(29550) == 29551
    with pytest.raises(ValueError, match="the silence must be over twice the beat"):
        LinkConfig("h", 1, silence_seconds=1, join_seconds=1, beat_seconds=1)
    with pytest.raises(ValueError, match="port must be in"):
        LinkConfig("h", 0, silence_seconds=10, join_seconds=1)
