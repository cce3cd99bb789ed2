"""What every service function works with: settings, the catalog, the store, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import Engine

from ckpt.core.storage import ObjectStore, open_store
from service.auth.cache import TokenCache
from service.db import Transaction, make_engine, reads, transactions
from service.metrics import Metrics
from service.settings import Settings


@dataclass
class Context:
    settings: Settings
    engine: Engine
    transaction: Transaction
    read: Transaction  # a read that takes no lock, or one statement (``service.db.reads``)
    store: ObjectStore
    tokens: TokenCache
    metrics: Metrics = field(default_factory=Metrics)

    @classmethod
    def create(cls, settings: Settings) -> Context:
        engine = make_engine(settings.database_url)
        return cls(
            settings=settings,
            engine=engine,
            transaction=transactions(engine),
            read=reads(engine),
            store=open_store(settings.store),
            tokens=TokenCache(settings.token_cache_seconds),
        )

    def close(self) -> None:
        self.engine.dispose()
