"""The audit log of bundles: every change of a bundle's state (who, what, when, why)."""
