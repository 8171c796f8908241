"""Data plane on UCX: the worker boundary, registered memory, staging, wire framing."""

from kvstream.dataplane.memory import RegisteredKV as RegisteredKV
from kvstream.dataplane.staging import StagingPool as StagingPool
from kvstream.dataplane.ucx import UcxWorker as UcxWorker

__all__ = ("RegisteredKV", "StagingPool", "UcxWorker")
