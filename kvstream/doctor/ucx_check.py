"""Run the UCX probe (``ucx_probe``) in a child process under a deadline and read what
UCX wrote about it.

Why a child: UCX and ucxx write to the C-level stdout (``--json`` must print only JSON),
UCX reads its settings once per process (``UCX_PROTO_INFO``, ``UCX_LOG_FILE``), and a
stuck UCX call must not hang the doctor. The child runs in its own process group, so
a deadline kills it and the receiver it spawned together.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

import msgspec

from kvstream.doctor.report import LinkCheck, UcxReport
from kvstream.doctor.ucx_log import UcxLog, parse_log, used_transports
from kvstream.doctor.ucx_probe import Plan, ProbeResult

__all__ = ["RunningProbe", "start_probe"]

_ENV_PREFIXES = ("UCX_", "UCXX_")


def _tail(text: str, limit: int = 300) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    out = " / ".join(lines[-3:])
    return out if len(out) <= limit else "..." + out[-limit:]


def _libucx_dir() -> Path | None:
    spec = find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _start_ucx_info() -> subprocess.Popen[str] | None:
    """``ucx_info -d`` of the UCX wheel that ucxx loads (not a system UCX), started now;
    None when it is not there."""
    base = _libucx_dir()
    if base is None or not (base / "bin" / "ucx_info").is_file():
        return None
    env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(base / "lib"), env.get("LD_LIBRARY_PATH", "")) if p)
    try:
        return subprocess.Popen([str(base / "bin" / "ucx_info"), "-d"], env=env, text=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None


def _available(proc: subprocess.Popen[str] | None, timeout: float) -> tuple[str, ...] | None:
    """The transports UCX can open on this host, as ``ucx_info -d`` lists them."""
    if proc is None:
        return None
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None
    found = re.findall(r"^#\s+Transport:\s+(\S+)", out, flags=re.MULTILINE)
    return tuple(dict.fromkeys(found)) if proc.returncode == 0 and found else None


class RunningProbe:
    """A probe started by ``start_probe``; ``finish()`` waits for it (at most until its
    deadline) and returns the report. Always call ``finish()``: it removes the files."""

    def __init__(self, plan: Plan, workdir: str, timeout: float, env: dict[str, str]) -> None:
        self._plan = plan
        self._workdir = workdir
        self._deadline = time.monotonic() + timeout
        self._timeout = timeout
        self._user_env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
        self._t0 = time.perf_counter()
        self._proc: subprocess.Popen[bytes] | None = None
        self._start_error = ""
        # First: it is done (0.4 s) long before the probe starts timing its link.
        self._ucx_info = _start_ucx_info()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "kvstream.doctor.ucx_probe",
                 msgspec.json.encode(plan).decode()],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            self._start_error = f"cannot start the UCX probe: {exc}"

    def _wait(self) -> tuple[str, str]:
        """(error, the probe's own output)."""
        if self._proc is None:
            return self._start_error, ""
        try:
            out, _ = self._proc.communicate(timeout=max(0.1, self._deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._kill()
            out, _ = self._proc.communicate()
            return f"the UCX probe did not finish within {self._timeout:g}s", out.decode(
                errors="replace")
        except BaseException:  # Ctrl-C: its own session does not get the signal
            self._kill()
            raise
        text = out.decode(errors="replace")
        if self._proc.returncode != 0:
            return f"the UCX probe exited with status {self._proc.returncode}: {_tail(text)}", text
        return "", text

    def _kill(self) -> None:
        """The probe and the receiver it spawned: the probe's process group."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)

    def finish(self) -> tuple[UcxReport, ProbeResult]:
        """Wait for the probe (until its deadline), read what it and UCX wrote, remove
        the files; the report and the probe's raw result."""
        try:
            error, output = self._wait()
            available = _available(self._ucx_info, max(0.1, self._deadline - time.monotonic()))
            result = self._result(output)
            log = self._log()
        finally:
            if self._ucx_info is not None and self._ucx_info.poll() is None:
                self._ucx_info.kill()
            shutil.rmtree(self._workdir, ignore_errors=True)
        return self._report(error or result.error, result, log, available), result

    def _result(self, output: str) -> ProbeResult:
        try:
            with open(self._plan.out, "rb") as f:
                return msgspec.json.decode(f.read(), type=ProbeResult)
        except (OSError, msgspec.DecodeError):
            return ProbeResult(error=f"the UCX probe wrote no result: {_tail(output)}"
                               if output.strip() else "the UCX probe wrote no result")

    def _log(self) -> UcxLog:
        texts = []
        for path in sorted(Path(self._workdir).glob("ucx.*.log")):
            with contextlib.suppress(OSError):
                texts.append(path.read_text(errors="replace"))
        return parse_log("\n".join(texts))

    def _report(self, error: str, result: ProbeResult, log: UcxLog,
                available: tuple[str, ...] | None) -> UcxReport:
        host = used_transports(log, "host")
        source = "protocol usage" if host else ""
        if not host and log.tag_lanes and not error:
            host, source = log.tag_lanes, "endpoint lanes"
        device: tuple[str, ...] | None = None
        if self._plan.device:
            device = used_transports(log, "device")
            if not device and not log.tables and not result.device_error:
                device = log.tag_lanes
        link = None
        n = self._plan.link_bytes
        if result.link_seconds and result.memcpy_seconds:
            best, copy = min(result.link_seconds), min(result.memcpy_seconds)
            gbps = n / best / 1e9
            memcpy = n / copy / 1e9
            link = LinkCheck(nbytes=n, gbps=round(gbps, 3),
                             gbps_runs=tuple(round(n / s / 1e9, 3) for s in result.link_seconds),
                             memcpy_gbps=round(memcpy, 3), ratio=round(gbps / memcpy, 3),
                             transports=used_transports(log, "host", n) or host)
        return UcxReport(
            error=error, env=self._user_env, host_transports=host, device_transports=device,
            device_skipped="" if self._plan.device else "no CUDA",
            device_error=result.device_error, source=source, tag_lanes=log.tag_lanes,
            available_transports=available, log_warnings=log.warnings, link=link,
            seconds=round(time.perf_counter() - self._t0, 3))


def start_probe(*, link_bytes: int, device: str, timeout: float) -> RunningProbe:
    """Start the probe now (it runs while the caller does other checks).

    ``device``: "torch" or "cupy" to move device memory too, "" for host memory only.
    """
    workdir = tempfile.mkdtemp(prefix="kvstream-doctor-")
    plan = Plan(out=os.path.join(workdir, "result.json"), link_bytes=link_bytes,
                device=device, step_timeout=max(1.0, min(5.0, timeout / 4)))
    env = dict(os.environ)
    env.update(UCX_LOG_FILE=os.path.join(workdir, "ucx.%p.log"), UCX_PROTO_INFO="used",
               UCX_LOG_LEVEL="info", UCX_WARN_UNUSED_ENV_VARS="n")
    env.setdefault("UCXX_LOG_LEVEL", "ERROR")
    # The child imports the kvstream this process runs, wherever it came from.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return RunningProbe(plan, workdir, timeout, env)
