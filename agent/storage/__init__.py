"""Object stores: a small protocol over string keys, and its implementations."""

from agent.storage.base import ObjectStore, StoredObject, open_store
from agent.storage.directory import DirectoryStore

__all__ = ["DirectoryStore", "ObjectStore", "StoredObject", "open_store"]
