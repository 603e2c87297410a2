#!/usr/bin/env bash
# Fault injection on the local cluster: `node.sh kill NODE` SIGKILLs everything on one
# compute node (its slurmd, slurmstepd and job tasks), as a node crash would;
# `node.sh start NODE` starts its slurmd again and returns it to service.
set -euo pipefail
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(dirname "$0")/common.sh"
export SLURM_CONF="$LS_ETC/slurm.conf"
action=${1:-}; node=${2:-}
[ -n "$node" ] && [ -s "$LS_RUN/$node.uts" ] || { echo "usage: node.sh kill|start NODE (node1..node4)" >&2; exit 2; }
case $action in
  kill)
    pids=$(ls_pids_of_node "$node" | tr '\n' ' ')
    # shellcheck disable=SC2086  # $pids: the pids, a word each
    [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
    echo "killed ${node}: ${pids:-nothing running}" ;;
  start)
    ls_alive "slurmd-$node" >/dev/null && { echo "$node already running"; exit 0; }
    ls_start_node "$node"
    for _ in $(seq 50); do scontrol ping >/dev/null 2>&1 && break; sleep 0.2; done
    # A node whose jobs are still COMPLETING refuses RESUME: retry until it is usable.
    for _ in $(seq 150); do
      state=$(sinfo -h -n "$node" -o %T 2>/dev/null)
      case "$state" in idle|mixed|allocated) break ;; esac
      scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
      sleep 0.4
    done
    echo "started $node" ;;
  *) echo "usage: node.sh kill|start NODE" >&2; exit 2 ;;
esac
