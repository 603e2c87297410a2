"""``python -m launcher.report``: the command-line entry point; the code is :mod:`launcher.track.report`."""
from launcher.track.report import main

if __name__ == "__main__":
    raise SystemExit(main())
