"""The sending side of the TCP data plane: per lane one connection and one thread that
writes its frames in the order they were submitted.

Why a thread per connection and not a worker-thread hop per send: frames queued behind
each other go out back to back, without a round trip through the event loop between
them, and the loop's work per message is one hand-over and one wake-up (measured: about
half the loop CPU per GB of a hop per send, which cost a one-lane transfer ~5 % of a
plain stream on 2 cores). Frames up to ``FAST_SEND_BYTES`` that find the connection idle
are offered to the kernel without blocking, from the event loop, and skip the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from typing import Final

import anyio

from kvstream._exceptions import DataPlaneError
from kvstream.dataplane.tcp_conn import Conn

__all__ = ["FAST_SEND_BYTES", "Lane", "SendJob", "Sender"]

# Small enough to copy into the kernel from the event loop without stalling it.
FAST_SEND_BYTES: Final = 64 * 1024


class SendJob:
    """One frame handed to a sender thread."""

    def __init__(self, sender: Sender, parts: list[memoryview], sent: int) -> None:
        self.parts = parts
        self.sent = sent  # bytes the event loop already wrote (a fast send cut short)
        self.started = sent > 0
        self.error: str | None = None
        self._sender = sender
        self._done = anyio.Event()

    async def wait(self) -> None:
        """Until the kernel holds the whole frame. Cancelled before the thread took it, it
        is withdrawn (nothing sent); after, it is waited for: the kernel reads the buffer."""
        try:
            await self._done.wait()
        except BaseException:
            if self._sender.withdraw(self):
                raise
            with anyio.CancelScope(shield=True):
                await self._done.wait()
            raise
        if self.error is not None:
            raise DataPlaneError(self.error)

    def _finish(self, error: str | None) -> None:
        self.error = error
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits now
            self._sender.loop.call_soon_threadsafe(self._done.set)


class Sender:
    """A connection and its writer thread; once the connection is down it stays down."""

    def __init__(self, conn: Conn, loop: asyncio.AbstractEventLoop, name: str) -> None:
        self.conn = conn
        self.loop = loop
        self._cv = threading.Condition()
        self._jobs: deque[SendJob] = deque()
        self._busy = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def usable(self) -> bool:
        """Up, and, when idle, not closed by the peer (a restarted peer then costs a
        reconnect, not a frame written into a dead socket; a busy one fails its write)."""
        if not self.conn.down and not self._jobs and not self._busy and self.conn.peer_closed():
            self.stop()
        return not self.conn.down

    def submit(self, parts: list[memoryview]) -> SendJob | None:
        """Queue a frame (event-loop thread); None if it went out at once. OSError if the
        connection broke under the fast send (it is down then)."""
        total = sum(len(p) for p in parts)
        with self._cv:
            if self.conn.down:
                raise DataPlaneError("connection closed")
            sent = 0
            if total <= FAST_SEND_BYTES and not self._jobs and not self._busy:
                try:
                    sent = self.conn.try_send(parts)
                except OSError:
                    self.stop()
                    raise
                if sent == total:
                    return None
            job = SendJob(self, parts, sent)
            self._jobs.append(job)
            self._cv.notify()
        return job

    def withdraw(self, job: SendJob) -> bool:
        """Take a job back if the thread has not begun it; True if taken."""
        with self._cv:
            if job.started or job not in self._jobs:
                return False
            self._jobs.remove(job)
            return True

    def stop(self) -> None:
        """Down for good: wakes a blocked write (it fails) and the idle thread."""
        self.conn.shutdown()
        with self._cv:
            self._cv.notify_all()

    def _run(self) -> None:
        if not self.conn.acquire():  # the thread's own reference to the socket
            self._fail_queued("connection closed")
            return
        try:
            while True:
                with self._cv:
                    while not self._jobs and not self.conn.down:
                        self._cv.wait()
                    if self.conn.down:
                        break
                    job = self._jobs.popleft()
                    job.started = self._busy = True
                error = None
                try:
                    self.conn.send_rest(job.parts, job.sent)
                except OSError as exc:
                    error = f"TCP send failed: {exc}"
                    self.conn.shutdown()
                with self._cv:
                    self._busy = False
                job._finish(error)
        finally:
            self.conn.release()
            self._fail_queued("connection closed before the frame was sent")

    def _fail_queued(self, reason: str) -> None:
        with self._cv:
            jobs, self._jobs = list(self._jobs), deque()
        for job in jobs:
            job._finish(reason)


class Lane:
    """One of a peer's connections, made on first use and again after it broke."""

    def __init__(self, address: bytes, host: str, port: int) -> None:
        self.address, self.host, self.port = address, host, port  # its credentials' key
        self.lock = anyio.Lock()  # one connect at a time; waiters keep their order
        self.connecting = 0  # tasks in or waiting for the connect path
        self.sender: Sender | None = None
        self.dropped = False

    def ready(self) -> Sender | None:
        """The sender to submit to right now, if no task queued for a connect is ahead."""
        sender = self.sender
        if sender is None or self.connecting or not sender.usable():
            return None
        return sender

    def drop(self) -> None:
        self.dropped = True
        if self.sender is not None:
            self.sender.stop()
