"""``python -m train RUN_DIR``: one rank of a job (also under torchrun or alone)."""
import sys

from train.main import main

if __name__ == "__main__":
    sys.exit(main())
