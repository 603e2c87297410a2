"""The doctor job's contract between its two sides (``python -m launcher.doctor``).

The login side (:mod:`launcher.doctor`) composes an ordinary run whose entry point is
:data:`ENTRYPOINT`; every task of it (:mod:`train.doctor`) writes its facts to
``RUN_DIR/RANKS_DIR/rank{R}.json`` and rank 0 gathers them into ``RUN_DIR/DOCTOR_JSON``,
which the login side reads to print the report. Pure: no torch.
"""
ENTRYPOINT = "train.doctor:check"
DOCTOR_JSON = "doctor.json"
RANKS_DIR = "doctor"
