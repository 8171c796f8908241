"""The sidecar process and its local-socket protocol."""

from kvstream.sidecar.server import Sidecar as Sidecar

__all__ = ("Sidecar",)
