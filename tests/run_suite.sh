#!/usr/bin/env bash
# The whole suite (`make test`): pytest processes side by side on the local cluster's 4 nodes.
#   - the tests that need no Slurm cluster (mostly multi-rank CPU tests), all along;
#   - the tests marked `slurm`, in two runs at once, each confined to its own pair of nodes
#     (node features pair1/pair2 of slurm/cluster/up.sh, chosen by SBATCH_CONSTRAINT, which
#     every sbatch of the run inherits) and given whole test files (`--shard K/2`,
#     balanced on tests/durations.json);
#   - then the tests marked `slurm_whole` (every node idle, a job that preempts them all,
#     a dead node), alone on the cluster.
# Two pytest runs on a pair each rather than pytest-xdist: pytest 9.2 silently stopped
# honouring xdist groups (pytest-xdist#1386), and the pairs keep two runs' jobs apart.
# Arguments go to every run (e.g. -x, -k EXPR). The slurm runs stream; the others'
# output follows. Exit status: non-zero when a run fails, or when a run collects no test
# (pytest's 5) while no filter was given, or when nothing passed at all: an empty run
# never passes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

"$PY" -m pytest -m "not slurm" "$@" >"$logs/other.log" 2>&1 &
other=$!
SBATCH_CONSTRAINT=pair2 "$PY" -m pytest -m "slurm and not slurm_whole" --shard=2/2 "$@" >"$logs/pair2.log" 2>&1 &
pair2=$!
SBATCH_CONSTRAINT=pair1 "$PY" -m pytest -m "slurm and not slurm_whole" --shard=1/2 "$@" 2>&1 | tee "$logs/pair1.log"
pair1_rc=${PIPESTATUS[0]}
wait "$pair2"
pair2_rc=$?
echo
echo "==== slurm tests on node pair 2 (ran beside the ones above) ===="
cat "$logs/pair2.log"
echo
echo "==== slurm tests that need the whole cluster ===="
"$PY" -m pytest -m "slurm_whole" "$@" 2>&1 | tee "$logs/whole.log"
whole_rc=${PIPESTATUS[0]}
wait "$other"
other_rc=$?

echo
echo "==== tests that need no Slurm cluster (ran beside the ones above) ===="
cat "$logs/other.log"

# pytest's closing line of each run, e.g. "== 2 failed, 680 passed, 3 skipped in 812.3s =="
count() { tail -n 1 "$2" | grep -Eo "[0-9]+ $1" | grep -Eo "^[0-9]+" || echo 0; }
sum() { local n=0 f; for f in pair1 pair2 whole other; do n=$(( n + $(count "$1" "$logs/$f.log") )); done; echo $n; }
passed=$(sum passed); failed=$(( $(sum failed) + $(sum "errors?") )); skipped=$(sum skipped)
echo
echo "slurm on pair1: exit $pair1_rc; on pair2: exit $pair2_rc; whole cluster: exit $whole_rc; other part: exit $other_rc"
echo "suite: $passed passed, $failed failed, $skipped skipped"
status=0
for rc in $pair1_rc $pair2_rc $whole_rc $other_rc; do
  # 5: no test collected, an error unless a filter (-k, a path) was given and others ran
  if [ "$rc" -eq 5 ] && [ $# -gt 0 ]; then continue; fi
  [ "$rc" -eq 0 ] || status=1
done
[ "$passed" -gt 0 ] || status=1
exit $status
