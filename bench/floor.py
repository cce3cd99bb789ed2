"""The floor of ``bench/fleet.py`` and ``bench/steady.py``: the least a FastAPI +
SQLAlchemy service can do per request, on the same database: one primary-key SELECT of a
run (``/resumable``'s floor), or one primary-key UPDATE of an attempt (a heartbeat's),
answered as JSON.

    FLOOR_DATABASE_URL=postgresql+psycopg://... python -m uvicorn floor:app --app-dir bench
"""

from __future__ import annotations

import os

from fastapi import FastAPI
from sqlalchemy import create_engine, text

engine = create_engine(os.environ["FLOOR_DATABASE_URL"], pool_size=20, pool_pre_ping=True)
app = FastAPI()


@app.get("/readyz")
def ready() -> dict[str, bool]:
    return {"ready": True}


@app.get("/floor/{run_id}")
def floor(run_id: int) -> dict[str, object]:
    with engine.connect() as connection:
        row = connection.execute(
            text("SELECT id, name FROM run WHERE id = :id"), {"id": run_id}
        ).one_or_none()
    return {"id": row.id, "name": row.name} if row else {"id": None}


@app.post("/floor/attempts/{attempt_id}/beat")
def beat(attempt_id: int) -> dict[str, object]:
    """A heartbeat's floor: one UPDATE of the attempt by primary key, in one transaction."""
    with engine.begin() as connection:
        found = connection.execute(
            text("UPDATE attempt SET heartbeat_at = now() WHERE id = :id RETURNING id"),
            {"id": attempt_id},
        ).one_or_none()
    return {"id": found.id if found else None}
