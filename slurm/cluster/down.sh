#!/usr/bin/env bash
# Stop the local Slurm cluster of up.sh: cancel all jobs and wait (bounded) until the
# queue is empty, then TERM the daemons by pid file (KILL after a wait), then sweep up
# whatever of this instance is left (slurmstepd and job processes still running inside
# the node namespaces, daemons whose pid file is gone). Always exits 0; does nothing
# when nothing runs. State stays on disk (up.sh wipes it).
set -euo pipefail
# shellcheck source=common.sh source-path=SCRIPTDIR
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

t0=$(ls_now_ms)
stopped=   # set once anything of this instance was found running
DRAIN_TIMEOUT=${LOCALSLURM_DRAIN_TIMEOUT:-15}   # seconds for jobs to leave squeue
TERM_TIMEOUT=${LOCALSLURM_TERM_TIMEOUT:-10}     # seconds between TERM and KILL

# ---- 1. cancel every job, wait until the queue is empty --------------------------------
# scancel returns before the jobs are dead, and a slurmstepd can outlive a stopped
# slurmd, so stop the daemons only once slurmctld reports no jobs left.
if ls_alive slurmctld >/dev/null && [ -f "$SLURM_CONF" ]; then
  stopped=1
  ids=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
  if [ -n "$ids" ]; then
    # shellcheck disable=SC2086  # one argument per job id
    timeout 10 scancel $ids 2>/dev/null || true
    end=$(( $(date +%s) + DRAIN_TIMEOUT ))
    while [ -n "$(timeout 10 squeue -h -o %i 2>/dev/null || echo busy)" ]; do
      if [ "$(date +%s)" -ge "$end" ]; then
        ls_say "jobs still queued after ${DRAIN_TIMEOUT}s, stopping anyway"
        break
      fi
      sleep 0.2
    done
  fi
fi

# ---- 2. TERM daemons by pid file, in dependency order; KILL after a wait -------------
# stop NAME...: TERM those alive, wait up to TERM_TIMEOUT, KILL what is left.
stop() {
  local name pid pids=""
  for name in "$@"; do
    pid=$(ls_alive "$name") || continue
    kill -TERM "$pid" 2>/dev/null || true
    pids+="$pid "
  done
  [ -n "$pids" ] || return 0
  stopped=1
  if ! ls_wait_gone "$pids" "$TERM_TIMEOUT"; then
    ls_say "KILL after ${TERM_TIMEOUT}s: $* (pids $pids)"
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    ls_wait_gone "$pids" 5 || true
  fi
}
slurmds=()
for n in "${LS_NODES[@]}"; do slurmds+=("slurmd-$n"); done
# slurmctld flushes its last accounting records to slurmdbd on exit: stop it (and the
# nodes) before slurmdbd, and slurmdbd before its database and munge.
stop slurmctld "${slurmds[@]}"
stop slurmdbd
stop mariadb munged

# ---- 3. sweep: slurmstepd/job processes on our nodes, daemons without pid files ------
# Both TERM and KILL steps re-list the processes; job processes may fork meanwhile.
left=$(ls_all_pids | sort -un | tr '\n' ' ')
if [ -n "${left// /}" ]; then
  stopped=1
  ls_say "terminating leftover processes of this instance: $left"
  # shellcheck disable=SC2086
  kill -TERM $left 2>/dev/null || true
  ls_wait_gone "$left" 3 || true
  left=$(ls_all_pids | sort -un | tr '\n' ' ')
  # shellcheck disable=SC2086
  [ -z "${left// /}" ] || { kill -KILL $left 2>/dev/null || true; ls_wait_gone "$left" 3 || true; }
fi
rm -f "$LS_RUN"/*.pid "$LS_RUN"/*.uts 2>/dev/null || true

t1=$(ls_now_ms)
if [ -n "$stopped" ]; then
  ls_say "stopped in $(( (t1 - t0) / 1000 )).$(( (t1 - t0) % 1000 / 100 ))s ($LS_DIR)"
else
  ls_say "not running ($LS_DIR)"
fi
exit 0
