"""Integrations with the training frameworks people use instead of their own loop.

Each module needs its framework, an optional extra: ``ckpt.integrations.huggingface``
and ``ckpt.integrations.accelerate`` (``pip install 'ckpt-spot[hf]'``),
``ckpt.integrations.lightning`` (``pip install 'ckpt-spot[lightning]'``). This package imports neither, so ``import ckpt`` never does.
"""
