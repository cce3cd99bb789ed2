"""The bundle format: JSON skeletons, safetensors-compatible payloads, blob layout.

Nothing here does I/O; storage and orchestration live elsewhere.
"""
