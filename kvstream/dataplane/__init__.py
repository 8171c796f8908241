"""Data plane: the two stream halves, the ``Transport`` seam (UCX, loopback), staging, framing."""
