"""``python -m launcher.logs RUN_DIR [--rank N] [--follow]``: a run's logs, every rank's or one.

The code is :mod:`launcher.track.single`.
"""
import argparse
import sys
from pathlib import Path

from launcher.track.single import logs_main
from spec.rundir import RUN_JSON


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.logs", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="the run's directory (the run_dir: line the launcher printed)")
    parser.add_argument("--rank", type=int, default=None, help="only this rank's logs (default: every rank)")
    parser.add_argument("--follow", "-f", action="store_true", help="keep printing until the run ends")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / RUN_JSON).is_file():
        print(f"error: {run_dir}: no {RUN_JSON} there; pass a run directory (the run_dir: line of the launch)",
              file=sys.stderr)
        return 2
    try:
        return logs_main(run_dir, args.rank, args.follow)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
