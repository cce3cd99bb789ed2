"""The training state: the objects a checkpointer captures and the six layers made of them.

objects   the models, optimizers, schedulers, data, generators... gathered by name
layers    capture and restore of each layer, given the objects
capture   the layers in order: out of the objects for a save, back in for a resume
sharded   FSDP2's ``DTensor`` state back into the objects, resharded when needed
"""
