"""Moved: ``ckpt.migrations`` is the top-level package ``migrations``; this says so to old imports."""

raise ImportError(
    "ckpt.migrations moved: the Alembic environment is the top-level package 'migrations' (alembic.ini's script_location); upgrade a catalog with 'ckpt migrate'"
)
