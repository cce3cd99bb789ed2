"""What the ranks of one job agree on, behind one small interface.

base         the ``Ranks`` protocol, the single process, and ``job_ranks`` to pick
distributed  ``TorchRanks``: the same meetings over ``torch.distributed`` (gloo)
buckets      DDP's gradient bucket layout, saved and laid out again at a resume
"""
