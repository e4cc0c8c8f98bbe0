"""`threadkeeper serve --workers N`: N serving processes on one port.

With N = 1 the proxy serves in the process that was started (`app.run`). With N > 1 that
process becomes a supervisor that never serves a request:

    start      load the policies and migrate the store once (a bad policy, an unreachable
               store or a taken port stops the start here, before any worker exists), then
               fork N workers; each binds the port with SO_REUSEPORT (the kernel spreads
               new connections among them) and opens its own store pool, upstream pool,
               policy watcher and heartbeat owner (proxy/server/recovery.py)
    running    a worker that exits on its own (crash, OOM kill) is reaped, logged
               (`worker_exited`, with pid and exit code) and replaced by a new one; the
               new worker's start-up sweep sees the dead pid gone and ends its in_progress
               responses at once. Workers that die more than MAX_RESTARTS times within
               RESTART_WINDOW seconds are a crash loop: the supervisor stops the rest and
               exits 1, so the process manager above it sees the failure
    SIGTERM    (or SIGINT) each worker gets SIGTERM and shuts down as a single process
               does (in-flight requests finish, own leftovers end `incomplete`); workers
               still running after SHUTDOWN_TIMEOUT are killed. Exit 0 when all stopped
               cleanly, else 1.

Workers are siblings on one host, each with its own pid and heartbeat row, so one never
takes another for dead while it runs (`died_here` needs the pid gone), and the parent reaps
a dead worker before replacing it, so its pid really is gone. Linux (and other systems with
fork and SO_REUSEPORT) only; a worker also gets SIGTERM if the supervisor itself dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import multiprocessing
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType

import structlog

from proxy.policy import PolicyRegistry
from proxy.server import app as app_module
from proxy.server.startup import serving_fields
from proxy.settings import Settings, SettingsError

log = structlog.get_logger("threadkeeper.workers")

MAX_RESTARTS = 5
RESTART_WINDOW = 60.0  # seconds
SHUTDOWN_TIMEOUT = 70.0  # seconds; above aiohttp's 60 s graceful shutdown of a worker
PR_SET_PDEATHSIG = 1
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def serve(settings: Settings) -> int:
    """Serve until SIGTERM/SIGINT; the process exit code."""
    if settings.workers == 1:
        app_module.run(settings)
        return 0
    if not hasattr(socket, "SO_REUSEPORT") or "fork" not in multiprocessing.get_all_start_methods():
        raise SettingsError("--workers: more than one worker needs fork and SO_REUSEPORT (Linux)")
    if settings.store_url.endswith(":memory:"):
        raise SettingsError("--workers: an in-memory SQLite store cannot be shared by workers")
    policies = PolicyRegistry.load(settings.policies_dir)  # a bad policy stops the start: exit 2
    asyncio.run(_migrate(settings))
    with _reserved_port(settings) as port:
        settings = replace(settings, port=port)
        log.info("serving", **serving_fields(settings, policies, port))
        context = multiprocessing.get_context("fork")

        def start_worker() -> BaseProcess:
            process = context.Process(target=_worker, args=(settings,), daemon=False)
            process.start()
            return process

        return Supervisor(start_worker, settings.workers).run()


async def _migrate(settings: Settings) -> None:
    """Migrations run here, once, before any worker starts (the workers' own migrate()
    then finds nothing to do)."""
    from proxy.store import open_store

    store = await open_store(
        settings.store_url,
        connect_timeout=settings.store_connect_timeout,
        command_timeout=settings.store_command_timeout,
    )
    try:
        await store.migrate()
    finally:
        await store.close()


@contextlib.contextmanager
def _reserved_port(settings: Settings) -> Iterator[int]:
    """Binds (without listening) with SO_REUSEPORT: a port another program holds fails the
    start here, and port 0 becomes one real port all workers share. A socket that does not
    listen gets no connections."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((settings.host, settings.port))
        except OSError as exc:
            raise SettingsError(
                f"--port: cannot bind {settings.host}:{settings.port}: {exc}"
            ) from None
        yield int(sock.getsockname()[1])


def _worker(settings: Settings) -> None:
    """A worker process: SIGTERM and SIGINT held pending until run() has its handlers
    (one that came while the worker started, its heartbeat row already written, killed it
    with exit -15), SIGTERM when the supervisor dies, then serve like a single process."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    app_module.run(settings)


def start_with_stop_signals_held(start_worker: Callable[[], BaseProcess]) -> BaseProcess:
    """Fork with SIGTERM and SIGINT blocked, so the worker starts with them pending. Else
    one that came between the fork and the worker's own blocking ran the supervisor's
    handler, inherited by the child, and was lost: the worker served on until killed at
    SHUTDOWN_TIMEOUT (exit 1). The supervisor gets its own once the fork is done.

    The supervisor's objects (the imported modules, about half of what a busy worker
    tracks) are frozen first (gc.freeze): a worker's full collections skip them and
    leave their pages shared with the supervisor's."""
    gc.freeze()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return start_worker()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class Supervisor:
    """Keeps `count` workers running; see the module docstring for the rules."""

    def __init__(
        self,
        start_worker: Callable[[], BaseProcess],
        count: int,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.start_worker = start_worker
        self.count = count
        self.monotonic = monotonic
        self.workers: list[BaseProcess] = []
        self.deaths: list[float] = []
        self.stopping = False
        self.exit_code = 0

    def run(self) -> int:
        wake_read, wake_write = socket.socketpair()
        wake_read.setblocking(False)
        wake_write.setblocking(False)
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        old_fd = signal.set_wakeup_fd(wake_write.fileno())
        for signum in previous:
            signal.signal(signum, self._on_signal)
        try:
            self.workers = [self._start() for _ in range(self.count)]
            log.info("workers_started", pids=[w.pid for w in self.workers])
            while not self.stopping:
                wait([w.sentinel for w in self.workers] + [wake_read], timeout=None)
                with contextlib.suppress(BlockingIOError):
                    wake_read.recv(4096)
                self._replace_dead()
            self._stop_all()
        finally:
            signal.set_wakeup_fd(old_fd)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            wake_read.close()
            wake_write.close()
        return self.exit_code

    def _start(self) -> BaseProcess:
        return start_with_stop_signals_held(self.start_worker)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _replace_dead(self) -> None:
        for worker in [w for w in self.workers if not w.is_alive()]:
            worker.join()  # reaped: its pid no longer exists, so recovery may end its work
            self.workers.remove(worker)
            log.error("worker_exited", pid=worker.pid, exit_code=worker.exitcode)
            if self.stopping:
                continue
            now = self.monotonic()
            self.deaths = [t for t in self.deaths if now - t < RESTART_WINDOW] + [now]
            if len(self.deaths) > MAX_RESTARTS:
                log.error("workers_crash_loop", deaths=len(self.deaths), window=RESTART_WINDOW)
                self.stopping, self.exit_code = True, 1
                continue
            replacement = self._start()
            self.workers.append(replacement)
            log.info("worker_restarted", pid=replacement.pid, replaced=worker.pid)

    def _stop_all(self) -> None:
        for worker in self.workers:
            if worker.is_alive():
                worker.terminate()  # SIGTERM: a clean shutdown
        deadline = self.monotonic() + SHUTDOWN_TIMEOUT
        for worker in self.workers:
            worker.join(max(0.0, deadline - self.monotonic()))
            if worker.is_alive():
                log.error("worker_killed_at_shutdown", pid=worker.pid)
                worker.kill()
                worker.join()
            if worker.exitcode != 0:
                self.exit_code = 1
        log.info("workers_stopped", exit_code=self.exit_code)
