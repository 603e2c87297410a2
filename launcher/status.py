"""``python -m launcher.status``: the command-line entry point; the code is :mod:`launcher.track.status`."""
from launcher.track.status import main

if __name__ == "__main__":
    raise SystemExit(main())
