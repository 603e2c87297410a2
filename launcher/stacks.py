"""``python -m launcher.stacks RUN_DIR``: the command-line entry point; the code is :mod:`launcher.track.stacks`."""
from launcher.track.stacks import main

if __name__ == "__main__":
    raise SystemExit(main())
