"""``kvstream doctor``: what a user runs first on a new host, or when something is slow.

Modules: ``checks`` (``run_checks``: gather and judge), ``host`` (versions, hardware,
/dev/shm), ``nats_check``, ``ucx_check`` (runs ``ucx_probe`` in two local processes and
reads UCX's log with ``ucx_log``), ``report`` (the structs), ``text`` (plain text),
``command`` (click). Nothing heavy is imported here: torch and ucxx load when checks run.
"""

from kvstream.doctor.checks import run_checks as run_checks
from kvstream.doctor.command import doctor as doctor
from kvstream.doctor.report import STATUSES as STATUSES
from kvstream.doctor.report import Check as Check
from kvstream.doctor.report import DoctorReport as DoctorReport
from kvstream.doctor.report import Hardware as Hardware
from kvstream.doctor.report import LinkCheck as LinkCheck
from kvstream.doctor.report import NatsReport as NatsReport
from kvstream.doctor.report import SharedMemory as SharedMemory
from kvstream.doctor.report import UcxReport as UcxReport
from kvstream.doctor.report import Versions as Versions
from kvstream.doctor.text import format_report as format_report

__all__ = (
    "STATUSES",
    "Check",
    "DoctorReport",
    "Hardware",
    "LinkCheck",
    "NatsReport",
    "SharedMemory",
    "UcxReport",
    "Versions",
    "doctor",
    "format_report",
    "run_checks",
)
