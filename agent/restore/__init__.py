"""The restore path: find the resumable bundle, read and verify it, fall back.

resume    the bundle to resume from, read on every rank, and the fall back
download  one layer's blobs, downloaded in parallel and checked against their SHA-256
"""
