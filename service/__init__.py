"""The ckpt control plane: FastAPI over SQLAlchemy (PostgreSQL, or SQLite embedded).

Imports ``ckpt.core`` and never the agent; importing it never loads torch.
"""
