"""ckpt control plane.

This package's top level imports nothing: the agent imports ``service.contract`` (the wire
contract, pydantic only) without pulling in the web stack, and importing the service never
loads torch.
"""
