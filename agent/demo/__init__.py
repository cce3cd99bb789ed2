"""The demo: train a small model, kill it after a save, resume it in a new process, and
check that the result is bit-identical to an uninterrupted run."""
