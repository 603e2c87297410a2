"""``python -m train RUN_DIR``: one rank of a job (also under torchrun or alone)."""
import sys

from train.harness.preempt import PreemptionFlag

if __name__ == "__main__":
    flag = PreemptionFlag().install()  # before the slow imports: see train.harness.job
    from train.main import main

    sys.exit(main(flag=flag))
