#!/usr/bin/env bash
# The whole suite (`make test`) as two pytest processes side by side, one per core:
#   - the tests marked `slurm`, one after another: they share the local cluster's nodes,
#     and some kill a node, preempt a partition or fill the queue;
#   - the rest, mostly multi-rank CPU tests.
# Two processes rather than pytest-xdist's loadgroup: pytest 9.2 silently stopped
# honouring xdist groups (pytest-xdist#1386), which let the Slurm tests run concurrently.
# Arguments go to both runs (e.g. -x, -k EXPR). The slurm part streams; the other part's
# output follows it. Exit status: non-zero when either part fails or collects no test
# (pytest's 5), so an empty run never passes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

"$PY" -m pytest -m "not slurm" "$@" >"$logs/other.log" 2>&1 &
other=$!
"$PY" -m pytest -m slurm "$@" 2>&1 | tee "$logs/slurm.log"
slurm_rc=${PIPESTATUS[0]}
wait "$other"
other_rc=$?

echo
echo "==== tests that need no Slurm cluster (ran beside the ones above) ===="
cat "$logs/other.log"

# pytest's closing line of each part, e.g. "== 2 failed, 680 passed, 3 skipped in 812.3s =="
count() { tail -n 1 "$2" | grep -Eo "[0-9]+ $1" | grep -Eo "^[0-9]+" || echo 0; }
sum() { echo $(( $(count "$1" "$logs/slurm.log") + $(count "$1" "$logs/other.log") )); }
passed=$(sum passed); failed=$(( $(sum failed) + $(sum "errors?") )); skipped=$(sum skipped)
echo
echo "slurm part: exit $slurm_rc; other part: exit $other_rc"
echo "suite: $passed passed, $failed failed, $skipped skipped"
if [ "$slurm_rc" -ne 0 ] || [ "$other_rc" -ne 0 ]; then
  exit 1
fi
