"""The save path, in order: when, stage (the stall), then persist in the background.

policy    when ``maybe_save`` saves: every N steps and/or every T seconds
staging   reusable host buffers; the copy that is the whole stall
persist   hash, upload, record, commit on one background thread
upload    each layer's payload cut into blobs, hashed, stored unless held already
"""
