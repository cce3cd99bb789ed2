"""The training agent: capture, stage, persist and bit-exactly restore the six layers.

Import the public API from ``ckpt`` (``from ckpt import Checkpointer``). This package
knows torch; it imports ``ckpt.core`` and never the control plane (``ckpt.service``).
"""
