"""The scrubber: keeps "resumable" true after commit by re-reading stored blobs."""
