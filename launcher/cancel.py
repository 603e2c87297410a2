"""``python -m launcher.cancel``: the command-line entry point; the code is :mod:`launcher.track.cancel`."""
from launcher.track.cancel import main

if __name__ == "__main__":
    raise SystemExit(main())
