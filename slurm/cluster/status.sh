#!/usr/bin/env bash
# Is the local Slurm cluster of up.sh running? Prints each daemon's state, then sinfo
# and squeue. Exit 0 when every daemon is alive and slurmctld answers, 1 otherwise.
set -euo pipefail
# shellcheck source=common.sh source-path=SCRIPTDIR
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

up=0
daemons=(munged mariadb slurmdbd slurmctld)
for n in "${LS_NODES[@]}"; do daemons+=("slurmd-$n"); done
for d in "${daemons[@]}"; do
  if pid=$(ls_alive "$d"); then
    printf '%-14s alive (pid %s)\n' "$d" "$pid"
  else
    printf '%-14s DOWN\n' "$d"
    up=1
  fi
done
echo "SLURM_CONF=$SLURM_CONF"
if [ "$up" -eq 0 ] && timeout 10 scontrol ping >/dev/null 2>&1; then
  echo "--- sinfo"
  timeout 10 sinfo || up=1
  echo "--- squeue"
  timeout 10 squeue || up=1
else
  echo "cluster is not up (state dir $LS_DIR; start it with slurm/cluster/up.sh)"
  up=1
fi
exit "$up"
