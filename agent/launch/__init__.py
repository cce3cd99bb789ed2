"""``ckpt launch``: run a training command and restart it after a preemption or a crash.

supervisor  the loop: start, watch, forward signals, restart or stop
torchrun    what the supervisor reads of torchrun: whether a command runs it, how it ended
finished    how each rank tells the supervisor that it finished training
reaping     Linux process-tree chores: find the children, kill adopted orphans
"""
