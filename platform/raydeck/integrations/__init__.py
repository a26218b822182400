"""Integrations with training frameworks: each implements the framework's own interface on top of
raydeck's tracker and checkpoints (``raydeck.integrations.lightning`` for PyTorch Lightning).

Imported explicitly, so raydeck never imports a framework a job does not use.
"""
