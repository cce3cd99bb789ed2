"""The lineage dashboard: server-rendered pages under ``/ui/``, read-only, signed in with the
API's tokens (``docs/dashboard.md``)."""
