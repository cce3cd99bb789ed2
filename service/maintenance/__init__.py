"""Maintenance tasks (garbage collection, the scrubber) run one pass at a time across every
replica, each pass recorded in ``maintenance_pass``."""
