"""Replica-safe crash recovery (SPEC sections 7 and 8).

A response left `in_progress` by a process that died can never complete, so it must
become `incomplete`. With several replicas on one database, "left in_progress" is not
enough: another replica may still be streaming it. So every process instance (the app's
OWNER) heartbeats into the store while it runs, and its responses are orphaned only when
it is dead, which a sweep decides in two ways:

    same host   its pid no longer exists: dead now (a restart after kill -9 sees this at
                once; "same host" means same machine, boot and pid namespace, so a pid
                means the same process to both)
    any host    silent for STALE_AFTER (a lost machine, another container)

    start      heartbeat, then sweep
    running    heartbeat every HEARTBEAT_EVERY, sweep every SWEEP_EVERY (a replica that
               dies while the others run is cleaned up without any restart)
    shutdown   retire: this process's own leftovers become incomplete, its row goes

STALE_AFTER is several heartbeats long, so a slow database write or a few seconds of
clock skew between replicas does not make a live replica look dead.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from functools import cache
from pathlib import Path

import structlog

from proxy.clock import Clock, utc_iso
from proxy.periodic import every, running
from proxy.store.base import Heartbeat, HeartbeatStore

log = structlog.get_logger("threadkeeper.recovery")

HEARTBEAT_EVERY = timedelta(seconds=5)
SWEEP_EVERY = timedelta(seconds=15)
STALE_AFTER = timedelta(seconds=30)


@cache
def this_host() -> str:
    """Where a pid names one process: hostname, kernel boot and pid namespace (Linux);
    the hostname alone elsewhere."""
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        pass
    return "|".join(parts)


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def died_here(beat: Heartbeat) -> bool:
    """True only when certain: the owner ran on this host and its pid is gone."""
    return beat.host == this_host() and beat.pid > 0 and not pid_exists(beat.pid)


async def heartbeat(store: HeartbeatStore, owner: str, *, now: datetime) -> None:
    await store.heartbeat(owner, utc_iso(now), host=this_host(), pid=os.getpid())


async def sweep(
    store: HeartbeatStore, owner: str, *, now: datetime, stale_after: timedelta = STALE_AFTER
) -> int:
    """Mark the responses of dead owners incomplete (dead on this host, or silent since
    `now - stale_after`); returns how many. `owner` (this process) is never swept."""
    dead = [
        beat.owner for beat in await store.heartbeats() if beat.owner != owner and died_here(beat)
    ]
    abandoned = 0
    for dead_owner in dead:
        abandoned += await store.retire(dead_owner)
    abandoned += await store.abandon_dead(utc_iso(now - stale_after), except_owner=owner)
    if abandoned:
        log.warning("abandoned_responses_marked_incomplete", count=abandoned)
    return abandoned


@asynccontextmanager
async def keep_alive(store: HeartbeatStore, owner: str, clock: Clock) -> AsyncIterator[None]:
    """While the body runs, `owner` heartbeats and sweeps dead owners; on exit it retires.
    Times and intervals come from `clock` (the app's CLOCK)."""
    await heartbeat(store, owner, now=clock.now())
    await sweep(store, owner, now=clock.now())
    try:
        async with running(
            every(
                "heartbeat",
                HEARTBEAT_EVERY,
                lambda: heartbeat(store, owner, now=clock.now()),
                clock,
            ),
            every(
                "recovery_sweep", SWEEP_EVERY, lambda: sweep(store, owner, now=clock.now()), clock
            ),
        ):
            yield
    finally:
        leftovers = await store.retire(owner)
        if leftovers:
            log.warning("own_responses_marked_incomplete_at_shutdown", count=leftovers)
