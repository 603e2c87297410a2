# shellcheck shell=bash
# The training step of a job: sourced (never executed) by every training job's batch script,
# whose setup lines (slurm/submitit_adapter.step_loop) set the parameters below and source this
# file from the run's frozen code (RUN_ROOT/.code/<hash>/slurm/step_loop.sh, as the task wrapper:
# launcher/snapshot.py), so a requeued job runs the loop it was submitted with. It defines
# `srun` as a function, so the srun line submitit writes after the setup (its last argument: the
# job's submitit folder, RUN_DIR/slurm, or SWEEP/.arrays/UID/%a for an element of a job array, a
# link to RUN_DIR/slurm) runs through it. It also runs outside sbatch: sourced by a bash (>= 4.3)
# inside an allocation with the same variables set, then `srun ARGS... FOLDER`.
#
# Parameters (shell or environment variables, set before this file is sourced):
#   STO_RESTARTS     cluster.in_job_restarts: restarts of the step inside the job (0: it runs
#                    once, and STO_IN_JOB_RESTART is not set)
#   STO_GRACE_S      seconds a task may outlive the restart's request (restart_grace_s)
#   STO_PYTHON       the command (shell words) that starts Python with this project importable
#                    here, outside any container: records a failed Slurm call (python -m
#                    slurm.request failed) and a step that failed unrecorded in run.json
#   STO_REQUEST      RUN_DIR's file of what a task asks of Slurm (spec.rundir.SLURM_REQUEST)
#   STO_RESTART      RUN_DIR's file of a task's restart request (spec.rundir.RESTART)
#   STO_FACTS        RUN_DIR's file of the job's facts for the tasks (spec.rundir.SLURM_JOB)
#   STO_SPARES       cluster.spare_nodes (0 or unset: no hot spares); with spares:
#   STO_STEP_NODES   the step's nodes (cluster.nodes), and
#   STO_STEP_NTASKS  its tasks (cluster.nodes x tasks per node)
#   STO_AGENT        (exported) ranks per node when srun starts one agent a node that forks
#                    them (train/harness/agent.py); unset: one srun task a rank
#   STO_ALLOCATION   set: the script runs inside an allocation the user holds, not as a job of
#                    its own (launcher/allocation.py): srun asks STO_STEP_NODES and
#                    STO_STEP_NTASKS (it would take the whole allocation), and a task's request
#                    to requeue is not done (the run stays resumable: launcher.resume), one to
#                    cancel ends the step only, never the user's allocation
# The batch script defines `sto_slurm CMD ARGS` first (Slurm's client as found before
# cluster.env: slurm/submitit_adapter.slurm_client_lines); outside it, the client on the PATH.
#
# The step function
# 1. writes RUN_DIR/STO_FACTS once (the job's fields with EndTime in epoch seconds, its
#    partition's nodes: the tasks' time left and room for an exclusion);
# 2. runs the step in the background and, every second while it runs and once after it,
#    does what a task asked in RUN_DIR/STO_REQUEST (slurm/request.py: requeue, requeue
#    without nodes, cancel; taken by a rename, so done once): the tasks call no Slurm
#    client, and a dead node's step (srun waits for it until Slurm declares it DOWN) is
#    requeued at once. A request done ends the script: Slurm requeues or ends the job.
#    Before a requeue the step's srun is killed: one still waiting on a dead node was seen
#    to outlive the requeue and, timing out, cancel "step N.0" of the job id, by then the
#    requeued job's own first step (test_node_failure's job ended FAILED on its new nodes);
# 3. starts the step again while it left RUN_DIR/STO_RESTART (a task's request: its failure
#    is one to restart; train/harness/restart.py) and restarts are left. srun returns
#    once every task of the step has ended, so the old step's processes are gone when the
#    next starts; STO_IN_JOB_RESTART numbers the starts (slurm.env.in_job_restart: the
#    rendezvous port follows it; unset for cluster.in_job_restarts=0: nothing restarts).
#    A task still running STO_GRACE_S s (restart_grace_s) after RESTART appeared is
#    one that cannot end by itself (a peer waiting in the rendezvous for a rank 0 that
#    failed to bind its port waits until train.dist_timeout_s): the loop ends the step
#    (scancel --signal=KILL of its newest step, in the background, and srun killed) and
#    starts the next. The teardown sees the last step's exit status (and uses sto_job).
#    A step that failed without RESTART (srun's --kill-on-bad-exit: a task died of a signal
#    or exited non-zero and srun SIGTERMed its peers before any recorded it) is handed to
#    `STO_PYTHON -m train.harness.restart after-srun` with srun's exit status and where its
#    messages begin in this script's stderr ("srun: error: NODE: task N: Killed"): run.json
#    gets the failure (rank_failure: the task, its node, the signal) unless a task recorded
#    one, and RESTART is written by the tasks' own rules (never before the run's first step,
#    nor twice for the same error at the same step). The loop goes on as for a task's request.
# 4. submits, every poll and once after the step, the checkpoints its tasks queued for
#    evaluation (RUN_DIR/evals/queue, eval.on_checkpoint: `STO_PYTHON -m launcher.evaljobs
#    submit`, with Slurm's client on the PATH), 10 s apart after a failed try (spec/evals.py).
# `wait -n` (bash >= 4.3) wakes at the step's end or after a second, whichever is first.
#
# With node agents (STO_AGENT set) the agents restart the step's ranks themselves, inside
# the same srun, while a restart drops no node: each agent that begins start K marks it
# (RUN_DIR/.RESTART.startK), and RESTART stays until the srun ends (every agent must read
# it; its JSON's "srun" says which start asked). Once srun ends, the loop takes the last
# start begun as this srun's, and a RESTART of an earlier start as done with (removed: the
# last start's failure, if any, is then recorded by after-srun). Each agent bounds its own
# ranks' end after a restart (SIGKILL), so the loop's own grace is not used; a RESTART that
# differs from the one seen before counts anew.
#
# With hot spares (cluster.spare_nodes=K > 0: sbatch --nodes=N+K --no-kill; STO_SPARES=0 is
# the loop without them) and node agents: the srun holds every node left (--nodes=N+K-dropped,
# one agent each, --no-kill: the step outlives a node Slurm declares DOWN), STO_AGENT_PLACES=N
# exported; the spares' agents stand by warm and take the dropped nodes' places themselves
# (train/harness/agent_places.py). srun waits for a dead node's task until Slurm declares
# it DOWN: once every agent off the dropped nodes has ended (RUN_DIR/.agents/NODE.end),
# the loop ends the srun and takes their worst status as the step's.
# With hot spares and one task a rank: every srun asks for the N training nodes (--nodes, --ntasks: srun
# would take the job's N+K from the batch environment) with --overlap, and --exclude for the
# nodes the job's restarts dropped: the old step's record holds its CPUs until Slurm hears
# from its dead node (seen with Slurm 22.05: without --overlap the next step waits for
# that). A restart that drops nodes (RESTART's line `exclude=NODES`: every node dropped in
# this job so far, train/harness/restart.py) ends the old srun itself two polls after the
# request (its surviving tasks have recorded and exit by then): srun would wait for the dead
# node's tasks until Slurm declares the node DOWN (SlurmdTimeout), and `scancel
# --signal=KILL` of the step ends anything left of it (in the background: it answers only
# after MessageTimeout, waiting for the dead node).

: "${STO_PYTHON:?the command of Python (slurm/step_loop.sh)}" "${STO_REQUEST:?the name of RUN_DIR/SLURM_REQUEST}" \
  "${STO_RESTART:?the name of RUN_DIR/RESTART}" "${STO_FACTS:?the name of RUN_DIR/slurm_job.txt}"
STO_RESTARTS=${STO_RESTARTS:-0} STO_GRACE_S=${STO_GRACE_S:-60} STO_SPARES=${STO_SPARES:-0}
declare -F sto_slurm >/dev/null || sto_slurm() { command "$@"; }  # outside the batch script

sto_job=${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}
sto_job=${sto_job:-$SLURM_JOB_ID}
sto_drop=  # with spares: the nodes this job's restarts dropped (RESTART's exclude=): srun --exclude
sto_failed() {
  echo "job $sto_job: scontrol $2 failed: $3" >&2
  eval "$STO_PYTHON"' -m slurm.request failed "$@"' || echo "job $sto_job: not recorded in run.json" >&2
}
sto_after_srun() {  # $1: RUN_DIR, $2: srun's exit status, $3: which start, $4: where its messages begin
  local log; log=$(readlink "/proc/$$/fd/2" 2>/dev/null)
  [ -f "$log" ] || log=/dev/null
  eval "$STO_PYTHON"' -m train.harness.restart after-srun "$1" "$2" "$3" "$STO_RESTARTS" "$log" "$4"' ||
    echo "job $sto_job: the failed step is not recorded in run.json" >&2
}
sto_restart_start() {  # $1: RUN_DIR; which start of the step wrote RESTART (its "srun"), else $2
  local start
  start=$(sed -n '1s/.*"srun": *\([0-9][0-9]*\).*/\1/p' "$1/$STO_RESTART" 2>/dev/null)
  echo "${start:-$2}"
}
sto_started() {  # $1: RUN_DIR; the last start node agents began in this srun (.RESTART.startK), else $2
  local f k last=$2
  for f in "$1/.$STO_RESTART".start*; do
    [ -e "$f" ] || continue
    k=${f##*.start}
    [ "$k" -gt "$last" ] 2>/dev/null && last=$k
  done
  echo "$last"
}
sto_kill_srun() {  # the step's srun, $! (a subshell: srun is its child); /proc first, pkill if need be
  local kids; kids=$(cat /proc/"$1"/task/*/children 2>/dev/null) || kids=$(pgrep -P "$1" 2>/dev/null)
  # shellcheck disable=SC2086  # $kids: the children's pids, a word each
  kill -KILL $kids "$1" 2>/dev/null
}
sto_end_step() {  # $1: the step's srun ($!), $2: why
  local step
  step=$(sto_slurm squeue -h -s -j "$SLURM_JOB_ID" -o %i 2>/dev/null |
    sed -n 's/^[0-9_]*[.]\([0-9][0-9]*\)$/\1/p' | sort -n | tail -n 1)  # the newest step: this srun's
  echo "$(date -u +%FT%TZ) $2: ending step ${step:-?} of job $sto_job" >&2
  # in the background: scancel answers after MessageTimeout when a node of the step is dead
  [ -n "$step" ] && { sto_slurm scancel --signal=KILL "$SLURM_JOB_ID.$step" 2>/dev/null & }
  sto_kill_srun "$1"
}
sto_eval_at=0  # with eval.on_checkpoint: no submission before this time (SECONDS) after one failed
sto_evals() {  # $1: RUN_DIR; submit the checkpoints queued for evaluation (launcher/evaljobs.py)
  local queued=("$1"/evals/queue/*.json)
  [ -e "${queued[0]}" ] && [ "$SECONDS" -ge "$sto_eval_at" ] || return 0
  (PATH="${sto_slurm_path:-$PATH}:$PATH"; eval "$STO_PYTHON"' -m launcher.evaljobs submit "$1"') || sto_eval_at=$((SECONDS + 10))
}
sto_request() {
  local taken="$1/.$STO_REQUEST.taken" action nodes reason out
  [ -e "$1/$STO_REQUEST" ] && mv -f "$1/$STO_REQUEST" "$taken" 2>/dev/null || return 1
  action=$(sed -n 's/^action=//p' "$taken")
  nodes=$(sed -n 's/^exclude=//p' "$taken")
  reason=$(sed -n 's/^reason=//p' "$taken")
  echo "the step asks: $action job $sto_job${nodes:+ without $nodes} ($reason)" >&2
  if [ -n "${STO_ALLOCATION:-}" ]; then  # the user's allocation: never requeued nor cancelled by us
    echo "inside allocation $sto_job: not done; resume the run with python -m launcher.resume $(cd "$1" && pwd)" >&2
    [ "$action" = cancel ] && [ -n "$2" ] && sto_kill_srun "$2"
    return 1
  fi
  if [ -n "$2" ] && [ "$action" != cancel ]; then  # the step's srun, still running: gone before the requeue
    sto_kill_srun "$2"; wait "$2" 2>/dev/null
  fi
  case $action in
    requeue) out=$(sto_slurm scontrol requeue "$sto_job" 2>&1) || { sto_failed "$1" requeue "$out"; return 1; } ;;
    exclude)
      trap '' TERM  # the hold-requeue's SIGTERM must not end this script before the release
      out=$(sto_slurm scontrol requeuehold "$sto_job" 2>&1) || { sto_failed "$1" requeuehold "$out"; trap - TERM; return 1; }
      out=$(sto_slurm scontrol update "JobId=$sto_job" "ExcNodeList=$nodes" 2>&1) || sto_failed "$1" update "$out"
      out=$(sto_slurm scontrol release "$sto_job" 2>&1) || sto_failed "$1" release "$out" ;;
    cancel) out=$(sto_slurm scancel "$sto_job" 2>&1) || { echo "scancel $sto_job failed: $out" >&2; return 1; } ;;
    *) echo "job $sto_job: unknown request $action" >&2; return 1 ;;
  esac
}
sto_agents_ended() {  # $1: RUN_DIR, $2: the nodes dropped; every agent of the srun off them ended: the worst status
  local f node worst=0 code
  for f in "$1"/.agents/*.up; do
    [ -e "$f" ] || return 1
    node=${f##*/}; node=${node%.up}
    case ",$2," in *",$node,"*) continue ;; esac
    code=$(cat "$1/.agents/$node.end" 2>/dev/null) || return 1
    [ "${code:-1}" -gt "$worst" ] && worst=${code:-1}
  done
  echo "$worst"
}
srun() {
  local folder="${*: -1}" code i=0 pid waited drop from seen now ended gone spare=()
  local dir="${folder//%a/$SLURM_ARRAY_TASK_ID}/.."
  { SLURM_TIME_FORMAT=%s sto_slurm scontrol show job -o "$SLURM_JOB_ID"
    sto_slurm sinfo -h -N -p "$SLURM_JOB_PARTITION" -o '%N|%t|%f'; } 2>/dev/null > "$dir/$STO_FACTS"
  while :; do
    rm -f "$dir/$STO_RESTART" "$dir/$STO_REQUEST" "$dir/.$STO_RESTART".start*
    rm -rf "$dir/.agents"
    if [ "$STO_SPARES" -gt 0 ] && [ -n "${STO_AGENT:-}" ]; then  # an agent on every node left, the spares' warm
      IFS=, read -ra spare <<< "$sto_drop"
      now=$((STO_STEP_NODES + STO_SPARES - ${#spare[@]}))
      spare=(--nodes="$now" --ntasks="$now" --overlap --no-kill ${sto_drop:+"--exclude=$sto_drop"})
      export STO_AGENT_PLACES=$STO_STEP_NODES
    elif [ "$STO_SPARES" -gt 0 ]; then  # the training nodes of the job's, without those dropped
      spare=(--nodes="$STO_STEP_NODES" --ntasks="$STO_STEP_NTASKS" --overlap ${sto_drop:+"--exclude=$sto_drop"})
    elif [ -n "${STO_ALLOCATION:-}" ]; then  # the run's nodes of the allocation's
      spare=(--nodes="$STO_STEP_NODES" --ntasks="$STO_STEP_NTASKS")
    fi
    from=$(stat -L -c %s "/proc/$$/fd/2" 2>/dev/null) || from=0  # srun's messages follow (this script's stderr)
    if [ "$STO_RESTARTS" -gt 0 ]; then
      STO_IN_JOB_RESTART=$i sto_slurm srun "${spare[@]}" "$@" &
    else
      sto_slurm srun "${spare[@]}" "$@" &
    fi
    pid=$! waited=0 seen='' ended='' gone=''
    while kill -0 "$pid" 2>/dev/null; do
      sleep 1 & wait -n
      kill $! 2>/dev/null
      sto_request "$dir" "$pid" && exit 0
      sto_evals "$dir"
      if now=$(cksum 2>/dev/null < "$dir/$STO_RESTART"); then
        [ "$now" = "$seen" ] && waited=$((waited + 1)) || waited=1
        seen=$now
      fi
      if [ -n "${STO_AGENT_PLACES:-}" ]; then  # the agents restart in place; a dead node's task ends when Slurm says
        drop=$(sed -n 's/^exclude=//p' "$dir/$STO_RESTART" 2>/dev/null)
        [ -n "$drop" ] && [ "$drop" != "$gone" ] &&
          echo "$(date -u +%FT%TZ) the step restarts without $drop: spares' agents take the places, warm" >&2
        gone=${drop:-$gone}
        if [ -n "$gone" ] && ended=$(sto_agents_ended "$dir" "$gone"); then
          sto_end_step "$pid" "every agent has ended but on $gone (dropped)"
          break
        fi
      # RESTART is written whole (os.replace), its exclude= line with it: two polls that saw it
      elif [ "$STO_SPARES" -gt 0 ] && [ "$waited" -ge 2 ] && grep -q '^exclude=.' "$dir/$STO_RESTART" 2>/dev/null; then
        sto_end_step "$pid" "the step asks for a restart without $(sed -n 's/^exclude=//p' "$dir/$STO_RESTART")"
        break
      fi
      [ -z "${STO_AGENT:-}" ] && [ "$waited" -ge "$STO_GRACE_S" ] &&
        { sto_end_step "$pid" "a task still runs $STO_GRACE_S s after the restart was asked"; break; }
    done
    wait "$pid"
    code=$?
    code=${ended:-$code}  # the agents' own statuses, not the killed srun's
    sto_evals "$dir"
    sto_request "$dir" && exit 0
    i=$(sto_started "$dir" "$i")  # this srun's start, or the last its agents began
    [ "$(sto_restart_start "$dir" "$i")" -lt "$i" ] && rm -f "$dir/$STO_RESTART"  # an earlier start's: done with
    [ "$code" -ne 0 ] && [ ! -e "$dir/$STO_RESTART" ] && sto_after_srun "$dir" "$code" "$i" "$from"
    [ "$code" -ne 0 ] && [ -e "$dir/$STO_RESTART" ] && [ "$i" -lt "$STO_RESTARTS" ] || return "$code"
    i=$((i + 1))
    if [ "$STO_SPARES" -gt 0 ]; then
      drop=$(sed -n 's/^exclude=//p' "$dir/$STO_RESTART")
      sto_drop=${drop:-$sto_drop}
    fi
    echo "$(date -u +%FT%TZ) the step failed (exit $code; $(cat "$dir/$STO_RESTART")):" \
      "restart $i of $STO_RESTARTS inside job $sto_job" >&2
  done
}
