"""Moved: ``ckpt.service`` is the top-level package ``service``; this says so to old imports."""

raise ImportError(
    "ckpt.service moved: the control plane is the top-level package 'service' (ckpt.service.app is service.app); start it with 'ckpt server'"
)
