"""kvstream doctor without UCX or NATS: the text form, the JSON form, reading UCX's log,
and the judgement of hand-made facts."""

from __future__ import annotations

import msgspec

from kvstream.control.reach import ServerProbe
from kvstream.doctor import (
    Check,
    DoctorReport,
    Hardware,
    LinkCheck,
    NatsReport,
    SharedMemory,
    UcxReport,
    Versions,
    format_report,
)
from kvstream.doctor.checks import judge
from kvstream.doctor.ucx_log import parse_log, used_transports

VERSIONS = Versions(kvstream="0.1.0", python="3.11.7", ucxx="0.52.00", ucx="1.21.0",
                    torch="2.13.0+cpu", torch_cuda="", nats_py="2.16.0", msgspec="0.23.0",
                    numpy="2.4.6", cupy="", cuda_packages={"ucxx-cu12": "0.52.0"})
HARDWARE = Hardware(cpu_count=2, memory_total_bytes=8 << 30, cuda_available=False, gpu_count=0)
SHM = SharedMemory(path="/dev/shm", exists=True, total_bytes=64 << 20, free_bytes=60 << 20,
                   transparent_hugepages="madvise")
LINK = LinkCheck(nbytes=64 << 20, gbps=5.2, gbps_runs=(5.0, 5.2, 4.9), memcpy_gbps=7.0,
                 ratio=0.743, transports=("cma",))
UCX = UcxReport(host_transports=("sysv", "cma"), device_skipped="no CUDA",
                source="protocol usage", tag_lanes=("sysv", "cma"),
                available_transports=("self", "tcp", "sysv", "posix", "cma"), link=LINK)
NATS_UP = NatsReport(url="nats://127.0.0.1:4222", connected=True, connect_ms=1.5, flush_ms=0.4,
                     servers=(ServerProbe(server="127.0.0.1:4222", reachable=True,
                                          version="2.15.1", jetstream=True),))
NATS_DOWN = NatsReport(url="nats://127.0.0.1:1", connected=False, cause="refused",
                       detail="connection refused (nothing listens on that port)",
                       servers=(ServerProbe(server="127.0.0.1:1", reachable=False,
                                            cause="refused"),))


def _report(checks: tuple[Check, ...], nats: NatsReport = NATS_UP) -> DoctorReport:
    return DoctorReport(checks=checks, versions=VERSIONS, hardware=HARDWARE, shm=SHM, ucx=UCX,
                        nats=nats, warnings=sum(c.status == "warn" for c in checks),
                        failures=sum(c.status == "fail" for c in checks), seconds=3.2)


def _by_name(checks: tuple[Check, ...]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_format_one_line_per_check_and_a_summary():
    checks = (Check(name="versions", status="ok", message="kvstream 0.1.0"),
              Check(name="shm", status="warn", message="/dev/shm has 60 MiB free: small"),
              Check(name="ucx.host", status="warn", message="host memory: tcp; " + "x" * 200),
              Check(name="ucx.device", status="skip", message="skipped: no CUDA"),
              Check(name="nats", status="fail", message="nats://127.0.0.1:1: refused"))
    lines = format_report(_report(checks)).splitlines()
    assert len(lines) == len(checks) + 1
    assert lines[0] == "ok    versions    kvstream 0.1.0"
    assert lines[1] == "WARN  shm         /dev/shm has 60 MiB free: small"
    assert lines[2].startswith("WARN  ucx.host    host memory: tcp; x") and lines[2].endswith("...")
    assert lines[3] == "skip  ucx.device  skipped: no CUDA"
    assert lines[4] == "FAIL  nats        nats://127.0.0.1:1: refused"
    assert lines[-1] == "kvstream doctor: 2 warnings, 1 failure"
    assert all(len(line) <= 100 for line in lines)


def test_summary_counts_agree_in_number():
    one = _report((Check(name="shm", status="warn", message="small"),))
    assert format_report(one).splitlines()[-1] == "kvstream doctor: 1 warning, 0 failures"


def test_json_form_round_trips():
    report = _report(judge(VERSIONS, HARDWARE, SHM, UCX, NATS_UP))
    wire = msgspec.json.encode(msgspec.to_builtins(report))
    assert msgspec.json.decode(wire, type=DoctorReport) == report
    as_dict = msgspec.json.decode(wire)
    assert as_dict["ucx"]["host_transports"] == ["sysv", "cma"]
    assert as_dict["ucx"]["device_transports"] is None


def test_judge_a_healthy_host():
    checks = judge(VERSIONS, HARDWARE, msgspec.structs.replace(SHM, free_bytes=8 << 30),
                   UCX, NATS_UP)
    by = _by_name(checks)
    assert [c.name for c in checks] == ["versions", "cuda", "install", "hardware", "shm", "thp",
                                        "ucx", "ucx.host", "ucx.device", "link", "nats"]
    assert {c.status for c in checks} == {"ok", "skip"}
    assert by["ucx.device"].message == "skipped: no CUDA"
    assert by["ucx.host"].message == "host memory: sysv, cma"
    assert "5.20 GB/s over cma" in by["link"].message and "0.74x" in by["link"].message
    assert "NATS 2.15.1 (jetstream)" in by["nats"].message


def test_the_install_check_says_what_a_gpu_host_is_missing():
    from kvstream.doctor.checks import install_check

    gpu = msgspec.structs.replace(HARDWARE, cuda_available=True, gpu_count=1)
    cu13 = msgspec.structs.replace(VERSIONS, torch="2.11.0+cu130", torch_cuda="13.0")

    def check(pkgs: dict[str, str], versions: Versions = cu13, hw: Hardware = gpu) -> Check:
        return install_check(msgspec.structs.replace(versions, cuda_packages=pkgs), hw)

    assert check({}, VERSIONS, HARDWARE).message == \
        "UCX (ucxx) is missing: pip install 'kvstream[cpu]'"
    assert check({"ucxx-cu12": "0.52.0"}, VERSIONS, HARDWARE).status == "ok"
    wrong = check({"ucxx-cu12": "0.52.0", "cupy-cuda12x": "13.6"})
    assert wrong.status == "fail" and "torch runs CUDA 13.0" in wrong.message
    assert "'kvstream[cu13]'" in wrong.message
    both = check({"ucxx-cu12": "0.52.0", "ucxx-cu13": "0.52.0"})
    assert both.status == "fail" and "overwrite each other" in both.message
    no_cupy = check({"ucxx-cu13": "0.52.0"})
    assert no_cupy.status == "warn" and "cupy-cuda13x is missing" in no_cupy.message
    cupy12 = check({"ucxx-cu13": "0.52.0", "cupy-cuda12x": "13.6"})
    assert cupy12.status == "fail" and "keep only cupy-cuda13x" in cupy12.message
    good = check({"ucxx-cu13": "0.52.0", "cupy-cuda13x": "14.0"})
    assert good.status == "ok" and "match torch's CUDA 13.0" in good.message


def test_judge_warnings_and_failures():
    ucx = msgspec.structs.replace(
        UCX, env={"UCX_TLS": "tcp"}, host_transports=("tcp",), device_transports=("tcp",),
        link=msgspec.structs.replace(LINK, gbps=1.1, ratio=0.157, transports=("tcp",)))
    by = _by_name(judge(VERSIONS, HARDWARE, SHM, ucx, NATS_DOWN))
    assert by["shm"].status == "warn" and "60 MiB free" in by["shm"].message
    assert by["ucx"].status == "warn" and "UCX_TLS=tcp" in by["ucx"].message
    assert by["ucx.host"].status == "warn"
    assert "no shared memory used (UCX has cma, posix, sysv)" in by["ucx.host"].message
    assert by["ucx.device"].status == "warn" and "over TCP" in by["ucx.device"].message
    assert by["link"].status == "warn"
    assert by["nats"].status == "fail"
    assert by["nats"].message.startswith("nats://127.0.0.1:1: refused")
    assert "kvstream nats" in by["nats"].message


def test_judge_a_failed_probe_and_no_link_check():
    ucx = UcxReport(error="DataPlaneError: UCX worker setup failed: No such device",
                    log_warnings=("WARN transport 'rc' is not available",
                                  "ERROR no usable transports/devices"))
    by = _by_name(judge(VERSIONS, HARDWARE, SHM, ucx, NATS_UP, link_check=False))
    assert by["ucx.host"].status == "fail" and "No such device" in by["ucx.host"].message
    assert by["link"].status == "skip"
    assert by["ucx.log"].message == "UCX said: ERROR no usable transports/devices"


def _log(pid: int, body: str) -> str:
    """UCX's line prefix (time, host:pid, thread) before each line of ``body``."""
    return "".join(f"[1796123122.538047] [vm:{pid} :0]  {line}\n" for line in body.splitlines())


# What UCX 1.21 wrote (UCX_PROTO_INFO=used, UCX_LOG_LEVEL=info) for two processes on this
# machine kind, the sender's tagged sends and the receiver's rendezvous fetch (the lane
# line is cut short).
UCX_1_21_LOG = _log(5444, """\
   ucp_context.c:2659 UCX  INFO  Version 1.21.0 (loaded from libucp.so)
        parser.c:2355 UCX  WARN  unused environment variable: UCX_MEMTYPE_CACHE
    ucp_worker.c:1984 UCX  INFO    ucp_context_0 intra-node cfg#0 tag(sysv/memory cma/memory)  \
rma_am(posix/memory)
 +--------------------------------+---------------------------------------------------------+
 | ucp_context_0 intra-node cfg#0 | tagged message by ucp_tag_send* from host memory        |
 +--------------------------------+-------------------------------------------+-------------+
 | 0                        0..92 | eager short                               | sysv/memory |
 | 1                     93..8191 | eager copy-in copy-out                    | sysv/memory |
 | 5                      8K..inf | (?) rendezvous zero-copy read from remote | cma/memory  |
 +--------------------------------+-------------------------------------------+-------------+
""") + _log(5447, """\
 +--------------------------------+-----------------------------------------------------+
 | ucp_context_0 intra-node cfg#0 | rendezvous data fetch into host memory from host    |
 +--------------------------------+---------------------------------------+-------------+
 | 0                            0 | no data fetch                         |             |
 | 0                      1..1727 | (?) fragmented copy-in copy-out       | sysv/memory |
 | 5                    1728..inf | zero-copy read from remote            | cma/memory  |
 +--------------------------------+---------------------------------------+-------------+
""")

# The layout of UCX after 1.21 (src/ucp/proto/proto_debug.c, ucs_table): two title rows,
# a header row and a Count column; the cuda rows are made up in that layout.
UCX_NEXT_LOG = _log(77, """\
 +-------+---------+-----------------------------+----------------------------+
 | ucp_context_0 intra-node cfg#1                                             |
 | tagged message by ucp_tag_send* from cuda/GPU0 memory                      |
 +-------+---------+-----------------------------+----------------------------+
 | Count |  Range  |         Description         |           Config           |
 +-------+---------+-----------------------------+----------------------------+
 |     2 | 0..8191 | eager copy-in copy-out      | cuda_copy/cuda, tcp/eth0   |
 |     0 | 8K..1M  | rendezvous zero-copy        | 60% on tcp/eth0 40% tcp/lo |
 |     1 | 1M..inf | rendezvous cuda_ipc         | cuda_ipc/cuda              |
 +-------+---------+-----------------------------+----------------------------+
ucp_worker.c:1984 UCX  INFO  ucp_context_0 intra-node cfg#1 tag(cuda_copy/cuda cuda_ipc/cuda)
""")


def test_parse_ucx_1_21_usage_tables():
    log = parse_log(UCX_1_21_LOG)
    assert [(t.pid, t.memory) for t in log.tables] == [(5444, "host"), (5447, "host")]
    assert [r.count for r in log.tables[0].rows] == [0, 1, 5]
    assert log.tables[0].rows[2].lo == 8192 and log.tables[0].rows[2].hi is None
    assert log.tables[0].rows[2].description == "rendezvous zero-copy read from remote"
    assert used_transports(log, "host") == ("sysv", "cma")
    assert used_transports(log, "host", 64 << 20) == ("cma",)
    assert used_transports(log, "device") == ()
    assert log.tag_lanes == ("sysv", "cma")
    assert log.warnings == ()  # "unused environment variable" is ucxx's own doing


def test_parse_the_layout_with_a_count_column():
    log = parse_log(UCX_NEXT_LOG)
    (table,) = log.tables
    assert table.memory == "device" and table.title.endswith("from cuda/GPU0 memory")
    assert [r.count for r in table.rows] == [2, 0, 1]
    assert table.rows[1].transports == ("tcp",) and table.rows[1].hi == 1 << 20
    assert used_transports(log, "device") == ("cuda_copy", "tcp", "cuda_ipc")
    assert used_transports(log, "host") == ()
    assert log.tag_lanes == ("cuda_copy", "cuda_ipc")


def test_parse_ignores_what_is_not_ucx():
    log = parse_log("hello\n| a | b | c |\n+---+\n[x] not a prefix\n")
    assert log.tables == () and log.tag_lanes == () and log.warnings == ()


def test_public_surface_and_a_light_import():
    import subprocess
    import sys
    import types

    import kvstream.doctor

    public = {n for n in dir(kvstream.doctor) if not n.startswith("_")
              and not isinstance(getattr(kvstream.doctor, n), types.ModuleType)}
    assert set(kvstream.doctor.__all__) == public
    # The CLI imports kvstream.doctor to register the command: no torch, no ucxx then.
    code = "import sys, kvstream.doctor; print(any(m in sys.modules for m in ('torch', 'ucxx')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
