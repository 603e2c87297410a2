"""``python -m launcher.plan``: see :mod:`launcher.plan.cli`."""
from launcher.plan.cli import main

if __name__ == "__main__":
    main()
