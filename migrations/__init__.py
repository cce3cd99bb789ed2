"""Alembic migrations of the catalog: the only way its schema changes (``ckpt migrate``)."""
