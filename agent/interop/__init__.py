"""Bundles in from and out to the formats other tools read and write."""
