"""Wire codecs: what a transfer's bytes look like on the wire (``none``, ``fp8_e4m3``, ``int8``).

``scheme`` says what goes on the wire, ``reference`` is the torch reference every kernel
matches bit for bit, ``codec`` runs a layer through the best backend available (CUDA
kernels, the CPU kernel, or the reference), ``accuracy`` measures what a codec costs.
"""

from kvstream.quant.scheme import CODECS, error_bound, wire_fingerprint, wire_layer_bytes

__all__ = ["CODECS", "error_bound", "wire_fingerprint", "wire_layer_bytes"]
