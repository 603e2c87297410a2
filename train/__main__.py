"""``python -m train RUN_DIR``: one rank of a job (also under torchrun or alone).

Started by the local launcher with ``STO_LOCAL_FORK`` set, it is rank 0 and forks the
other ranks of this machine after the imports (:mod:`train.harness.forked`).
"""
import sys

from train.harness.preempt import PreemptionFlag

if __name__ == "__main__":
    flag = PreemptionFlag().install()  # before the slow imports: see train.job
    from train.harness.forked import fork_ranks
    from train.main import main, warm_imports

    ranks = None
    if len(sys.argv) == 2:
        ranks = fork_ranks(sys.argv[1], lambda: main(flag=flag), warm_imports)  # each its own copy
    code = 1
    try:
        code = main(flag=flag)
    finally:
        if ranks is not None:
            code = ranks.finish(code)
    sys.exit(code)
