"""Moved: ``ckpt.agent`` is the top-level package ``agent``; this says so to old imports."""

raise ImportError(
    "ckpt.agent moved: the in-job agent is the top-level package 'agent', its modules grouped by phase (docs/architecture.md): import the public names from ckpt (from ckpt import Checkpointer), run the demo jobs as 'python -m agent.demo.train' and 'agent.demo.ranks'"
)
