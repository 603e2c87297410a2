"""The contract the login side (``launcher/``) and the compute side (``train/``) share.

Config schema, validation, layout rules, support matrix, model size, DeepSpeed JSON and
the run-directory layout. Imports nothing but the standard library and omegaconf/hydra
(for registration); never torch, never ``launcher`` or ``train``.
"""
