"""The data layer: where in its data a run is, and how it continues from there.

sampling  ``ResumableSampler`` (resumes in O(1)) and ``PerSampleRNG``
sources   the adapters that drive and capture each kind of data pipeline
epochs    the loop's walk through the data from the restored position (``batches()``)
"""
