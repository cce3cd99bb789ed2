"""The torch-free lower layer that the agent and the control plane share.

    contract   the wire contract: manifests and the records of the commit protocol
    errors     the error tree the agent raises and the store's errors
    storage    the object-store protocol, the directory and S3 stores, the object keys
    verify     read a bundle's blobs back and check every SHA-256
    progress   a progress line for long transfers
    tokens     where a client finds its bearer token
    version    the distribution's version

Nothing here imports torch, FastAPI, SQLAlchemy, or another package of ours: the agent
(``agent``) and the control plane (``service``) import it, never each other.
"""
