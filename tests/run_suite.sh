#!/usr/bin/env bash
# The whole suite (`make test`): pytest processes side by side on the local cluster's 4 nodes.
#   - the tests that need no Slurm cluster (mostly multi-rank CPU tests), all along, in two
#     runs of whole files (`--shard K/2`): the suite is CPU-bound, and once the Slurm runs
#     end, one run alone would leave a core idle for the rest of it;
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
began=$(date +%s)
since=$(date +%Y-%m-%dT%H:%M:%S)  # for the closing line's sum of the Slurm jobs' CPU
# timed NAME CMD...: runs CMD, then writes its wall seconds to $logs/NAME.wall
timed() { local name=$1 t0; shift; t0=$(date +%s); "$@"; local rc=$?; echo $(( $(date +%s) - t0 )) >"$logs/$name.wall"; return $rc; }

timed other1 "$PY" -m pytest -m "not slurm" --shard=1/2 "$@" >"$logs/other1.log" 2>&1 &
other1=$!
timed other2 "$PY" -m pytest -m "not slurm" --shard=2/2 "$@" >"$logs/other2.log" 2>&1 &
other2=$!
SBATCH_CONSTRAINT=pair2 timed pair2 "$PY" -m pytest -m "slurm and not slurm_whole" --shard=2/2 "$@" >"$logs/pair2.log" 2>&1 &
pair2=$!
SBATCH_CONSTRAINT=pair1 timed pair1 "$PY" -m pytest -m "slurm and not slurm_whole" --shard=1/2 "$@" 2>&1 | tee "$logs/pair1.log"
pair1_rc=${PIPESTATUS[0]}
wait "$pair2"
pair2_rc=$?
echo
echo "==== slurm tests on node pair 2 (ran beside the ones above) ===="
cat "$logs/pair2.log"
echo
echo "==== slurm tests that need the whole cluster ===="
timed whole "$PY" -m pytest -m "slurm_whole" "$@" 2>&1 | tee "$logs/whole.log"
whole_rc=${PIPESTATUS[0]}
wait "$other1"
other1_rc=$?
wait "$other2"
other2_rc=$?

echo
echo "==== tests that need no Slurm cluster, part 1 of 2 (ran beside the ones above) ===="
cat "$logs/other1.log"
echo
echo "==== tests that need no Slurm cluster, part 2 of 2 (ran beside the ones above) ===="
cat "$logs/other2.log"

# pytest's closing line of each run, e.g. "== 2 failed, 680 passed, 3 skipped in 812.3s =="
count() { tail -n 1 "$2" | grep -Eo "[0-9]+ $1" | grep -Eo "^[0-9]+" || echo 0; }
sum() { local n=0 f; for f in pair1 pair2 whole other1 other2; do n=$(( n + $(count "$1" "$logs/$f.log") )); done; echo $n; }
passed=$(sum passed); failed=$(( $(sum failed) + $(sum "errors?") )); skipped=$(sum skipped)
echo
echo "slurm on pair1: exit $pair1_rc; on pair2: exit $pair2_rc; whole cluster: exit $whole_rc; others: exit $other1_rc, $other2_rc"
echo "suite: $passed passed, $failed failed, $skipped skipped"
wall() { cat "$logs/$1.wall" 2>/dev/null || echo "?"; }
echo "wall: $(( $(date +%s) - began )) s in all; others $(wall other1) s and $(wall other2) s, pair1 $(wall pair1) s, pair2 $(wall pair2) s, whole cluster $(wall whole) s"
# What the Slurm jobs cost (their CPU is not the pytest processes'): a budget to watch.
eval "$(bash slurm/cluster/env.sh 2>/dev/null)"; sacct -a -n -P -S "$since" -o JobID,TotalCPU 2>/dev/null | "$PY" -c '
import sys
def s(t):  # [D-]HH:MM:SS[.mmm] or MM:SS.mmm
    d, _, t = t.rpartition("-")
    parts = [float(p) for p in t.split(":")]
    return int(d or 0) * 86400 + sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
rows = [line.strip().split("|") for line in sys.stdin if "|" in line]
times = [s(cpu) for job, cpu in rows if "." not in job]  # the job line sums its steps
print(f"slurm jobs: {len(times)}, their CPU {sum(times) / 60:.1f} min")' || true
status=0
for rc in $pair1_rc $pair2_rc $whole_rc $other1_rc $other2_rc; do
  # 5: no test collected, an error unless a filter (-k, a path) was given and others ran
  if [ "$rc" -eq 5 ] && [ $# -gt 0 ]; then continue; fi
  [ "$rc" -eq 0 ] || status=1
done
[ "$passed" -gt 0 ] || status=1
exit $status
