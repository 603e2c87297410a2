"""``python -m launcher.list [ROOT]``: the command-line entry point; the code is :mod:`launcher.track.catalog`."""
from launcher.track.catalog import main

if __name__ == "__main__":
    raise SystemExit(main())
