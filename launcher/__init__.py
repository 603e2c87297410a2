"""Login side: compose, validate, plan, submit, track, report. No torch at import time."""
