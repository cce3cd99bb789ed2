"""The save path, in order: whether to save, stage (the stall), persist in the background.

policy    ``Position``, and when a step boundary is due by steps or seconds
schedule  whether ``maybe_save`` saves now: the policy, notices, signals, the save in flight
staging   the layers captured and copied into reusable host buffers: the whole stall
unchanged which tensors still hold their last save's bytes (no copy, no hash)
snapshot  a staged save: its tensors, the copies left for later, the next step's wait
persist   hash, upload, record, commit on one background thread
upload    each layer's payload cut into blobs, hashed, stored unless held already
result    ``PendingSave`` (staged) and ``SaveResult`` (durable)
tax       what a save cost the loop's steps until durable, stall included
"""
