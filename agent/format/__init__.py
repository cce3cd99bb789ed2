"""The bundle format: JSON skeletons, safetensors-compatible payloads, blob layout.

Nothing here does I/O; storage and orchestration live elsewhere.

skeleton  a state object split into a JSON skeleton and named tensors, and joined back
payload   the safetensors-compatible layout of one (rank, layer)
chunking  where a payload is cut into blobs
sharding  any block of a sharded tensor, from the blocks the ranks saved
dtypes    the tensor dtypes a payload can hold
"""
