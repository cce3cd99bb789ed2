"""Other tools' checkpoints in and out of bundles.

loading    files read without unsafe unpickling (``torch.load(weights_only=True)``), errors
           that name the file
framework_keys  where ckpt's integrations keep their state (the importer fills the same)
sources    Hugging Face Trainer folders and Lightning ``.ckpt`` files, as ckpt's layers
dicts      ``torch.save`` dicts and DCP directories, as ckpt's layers
importing  ``import_checkpoint``: read a source, refuse or accept what it lacks, commit a bundle
exporting  ``export``: a bundle's verified blobs out as safetensors, Transformers, DCP or torch
           (export_plan, export_files, export_fill: the layout, the files, the bytes)
"""
