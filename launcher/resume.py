"""``python -m launcher.resume``: the command-line entry point; the code is :mod:`launcher.track.resume`."""
from launcher.track.resume import main

if __name__ == "__main__":
    raise SystemExit(main())
