"""One transfer: its pure lifecycle (``state``) and the engine's handle on it (``handles``).

Below the engine and the data plane: both drive a ``Transfer`` and neither owns it.
"""

from kvstream.transfer.handles import ReceiveHandle, SendHandle, Waitable, error_for
from kvstream.transfer.state import (
    TERMINAL,
    EndCause,
    Side,
    Transfer,
    TransferResult,
    TransferState,
)

__all__ = ["TERMINAL", "EndCause", "ReceiveHandle", "SendHandle", "Side", "Transfer",
           "TransferResult", "TransferState", "Waitable", "error_for"]
