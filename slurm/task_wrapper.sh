#!/bin/bash
# What srun starts for every task of a job: `task_wrapper.sh PYTHON ARGS...`.
#
# Slurm's warning signal (USR2: --signal's, sent up to 60 s early, or a preemption's) can
# come while a task's Python is still starting, before any handler exists: the task would
# die of it and its peers wait in the rendezvous until the time limit. Here Python starts
# with USR2 ignored (the disposition survives exec) while this shell, which has its trap
# set before Python exists, records the signal in $STO_USR2_MARK and passes it on. The
# harness's handler (train/harness/preempt.py) takes the mark as a signal received when
# it installs itself, so a signal at any moment of start-up still ends in a checkpoint and
# a requeue. TERM and INT are passed on too; the task's exit status is Python's.
mark="${TMPDIR:-/tmp}/sto-usr2-${SLURM_JOB_ID:-0}-${SLURM_PROCID:-0}-${SLURM_RESTART_COUNT:-0}-$$"
export STO_USR2_MARK="$mark"
child=
trap ': > "$STO_USR2_MARK"; [ -n "$child" ] && kill -USR2 "$child" 2>/dev/null' USR2
trap '[ -n "$child" ] && kill -TERM "$child" 2>/dev/null' TERM
trap '[ -n "$child" ] && kill -INT "$child" 2>/dev/null' INT
(trap '' USR2; exec "$@") &
child=$!
while :; do
  wait "$child"
  code=$?
  kill -0 "$child" 2>/dev/null || break  # a trapped signal interrupted `wait`: wait again
done
rm -f "$mark"
exit "$code"
