"""The plain-text form of a ``DoctorReport``: one line per check, then a summary."""

from __future__ import annotations

from typing import Final

from kvstream.doctor.report import DoctorReport

__all__ = ["WIDTH", "format_report", "summary"]

WIDTH: Final = 100
_MARK: Final = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def summary(report: DoctorReport) -> str:
    """``kvstream doctor: 2 warnings, 0 failures``."""
    return (f"kvstream doctor: {_plural(report.warnings, 'warning')}, "
            f"{_plural(report.failures, 'failure')}")


def format_report(report: DoctorReport) -> str:
    """The report as text, no line longer than ``WIDTH``; no trailing newline."""
    lines = []
    for check in report.checks:
        line = f"{_MARK.get(check.status, check.status):<4}  {check.name:<10}  {check.message}"
        lines.append(line if len(line) <= WIDTH else line[:WIDTH - 3] + "...")
    lines.append(summary(report))
    return "\n".join(lines)
