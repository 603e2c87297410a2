"""``python -m launcher.resume``: the command-line entry point; the code is :mod:`launcher.relaunch`."""
from launcher.relaunch import main

if __name__ == "__main__":
    raise SystemExit(main())
