"""The in-job agent: capture, stage, persist and bit-exactly restore the six layers.

Import the public API from ``ckpt`` (``from ckpt import Checkpointer``). This package knows
torch; it imports ``ckpt.core`` (the torch-free layer it shares with the control plane) and
never the control plane (``service``). Its modules and folders, those of a save first:

    checkpointer  the façade: the training loop's one handle (``Checkpointer``)
    config        keyword arguments and ``CKPT_*`` variables, validated
    counters      the run's counters; stateful: the ``state_dict`` protocol; summary: the
                  one line per resume and per durable save
    state/        the training objects and the six layers in and out of them
    data/         the data position: resumable samplers, pipeline adapters, the epochs walk
    save/         when to save, staging (the stall), upload and persist in the background
    restore/      find the resumable bundle, download and verify it, fall back
    catalog/      where bundles are kept: the store alone, or the control plane (its client,
                  the attempt's registration and heartbeats, manifests)
    interop/      other tools' checkpoints (Hugging Face, Lightning, DCP, torch.save) as bundles
    format/       the bundle's bytes: JSON skeletons, safetensors payloads, blob layout (pure)
    ranks/        what the ranks of a job agree on, alone or over ``torch.distributed``
    attempt/      how an attempt ends: stop signals, the grace period, clouds' notices, the
                  ``every="auto"`` interval, where its time went
    verify/       each step's fingerprint; a resume's replayed steps against the dead attempt's
    launch/       ``ckpt launch``: the one-machine supervisor
    demo/         ``ckpt demo`` and the demo jobs the tests and manifests run
"""
