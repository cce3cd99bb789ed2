"""The demo: train a small model, kill it after a save, resume it in a new process, and
check that the result is bit-identical to an uninterrupted run.

run      ``ckpt demo``: the chaos loop under ``ckpt launch``, then the comparison
train    the one-process demo job (the tests and the manifests run it too)
ranks    the many-rank demo job: DDP or FSDP2 under torchrun, gloo on the CPU
server   the control plane the demo talks to, started on a free port when none is given
report   what the demo prints at the end
compare  a resumed run's final state against an uninterrupted run's, bit for bit
"""
