"""Checkpoints: atomic, verified, resumable (see :mod:`.manager`)."""
