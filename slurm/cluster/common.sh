# shellcheck shell=bash disable=SC2034  # the settings are for the scripts that source this file
# Shared settings and helpers for the local Slurm cluster scripts (up/down/status/env).
# Sourced, never executed. Everything this cluster owns lives under ONE directory,
# ${LOCALSLURM_DIR:-/tmp/localslurm}; nothing is written to /etc, /run or /var.
# Knobs (environment): LOCALSLURM_DIR, LOCALSLURM_CTLD_PORT / _DBD_PORT / _SLURMD_PORT
# (a second instance beside the first needs other ports), LOCALSLURM_TIMEOUT (up.sh
# readiness, s), LOCALSLURM_DRAIN_TIMEOUT / _TERM_TIMEOUT (down.sh, s).

LS_SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# Absolute, normalised state directory (realpath -m: works before it exists).
LS_DIR=$(realpath -m "${LOCALSLURM_DIR:-/tmp/localslurm}")
LS_ETC=$LS_DIR/etc
LS_SPOOL=$LS_DIR/spool
LS_LOG=$LS_DIR/log
LS_RUN=$LS_DIR/run          # pid files, unix sockets, node namespace ids
LS_MUNGE=$LS_DIR/munge      # munge key + PRNG seed
LS_MYSQL=$LS_DIR/mysql      # MariaDB datadir
LS_MARKER=$LS_DIR/.localslurm   # proves the directory is ours before we wipe it

LS_CLUSTER=localslurm
LS_NODES=(node1 node2 node3 node4)
LS_NODE_CPUS=4
LS_NODE_MEM=4000
# Non-default ports so that a system Slurm (6817/6818/6819) can run beside us.
LS_CTLD_PORT=${LOCALSLURM_CTLD_PORT:-16817}
LS_DBD_PORT=${LOCALSLURM_DBD_PORT:-16819}
LS_SLURMD_PORT0=${LOCALSLURM_SLURMD_PORT:-16821}   # node K listens on PORT0 + K - 1

# Unix socket paths must stay under ~108 bytes (sun_path); we keep them < 100.
LS_MUNGE_SOCK=$LS_RUN/munge.sock
LS_MYSQL_SOCK=$LS_RUN/mysql.sock

export SLURM_CONF=$LS_ETC/slurm.conf
# Every daemon we start carries this in its environment, so that down.sh can find
# strays of THIS instance even when their pid files are gone.
LS_TAG="LOCALSLURM_INSTANCE=$LS_DIR"

LS_TIMEOUT=${LOCALSLURM_TIMEOUT:-60}

# name -> pid file; the slurmd ones are slurmd-nodeK.
ls_pidfile() { echo "$LS_RUN/$1.pid"; }
ls_logfile() { echo "$LS_LOG/$1.log"; }

# fd 9 = the caller's stderr, so messages get through even from inside a command whose
# output a polling loop sends to /dev/null.
exec 9>&2
ls_say() { echo "localslurm: $*" >&9; }

# die REASON [LOGFILE]: one-line reason, then the tail of the relevant log.
ls_die() {
  echo "localslurm: ERROR: $1" >&9
  if [ -n "${2:-}" ] && [ -f "$2" ]; then
    echo "---- tail of $2 ----" >&9
    tail -n 20 "$2" >&9
  fi
  exit 1
}

# Pid stored in a pid file, if that process is alive (prints it), else non-zero.
ls_alive() {
  local f pid
  f=$(ls_pidfile "$1")
  [ -s "$f" ] || return 1
  pid=$(head -n1 "$f" 2>/dev/null | tr -dc 0-9)
  [ -n "$pid" ] && ls_running "$pid" || return 1
  # A recycled pid would not be one of our processes: it must carry our tag or path.
  ls_is_ours "$pid" || return 1
  echo "$pid"
}

# True if process PID belongs to this instance: our state dir in its command line or
# our tag in its environment.
ls_is_ours() {
  local pid=$1
  tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qxF "$LS_TAG" && return 0
  tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$LS_DIR/" && return 0
  return 1
}

# Pids of every process running inside one of our node namespaces (slurmd, slurmstepd
# and job processes). up.sh records each node's UTS namespace id in run/nodeK.uts; the
# hostname check guards against an id the kernel reused after our node was gone.
ls_node_pids() {
  local f line p ns ids=""
  for f in "$LS_RUN"/node*.uts; do [ -s "$f" ] && ids+="$(cat "$f")"$'\n'; done
  [ -n "$ids" ] || return 0
  # One find lists every process's UTS namespace ("/proc/PID/ns/uts uts:[ID]").
  find /proc/[0-9]*/ns/uts -maxdepth 0 -printf '%p %l\n' 2>/dev/null | while read -r p ns; do
    while read -r f line; do   # f = node name, line = its namespace id
      [ -n "$f" ] && [ "$ns" = "$line" ] || continue
      p=${p#/proc/}; p=${p%%/*}
      ls_running "$p" && [ "$(nsenter --uts="/proc/$p/ns/uts" hostname 2>/dev/null)" = "$f" ] && echo "$p"
      break
    done <<<"$ids"
  done
  return 0
}

# All processes of this instance still alive: our daemons (by name, and by tag or path,
# so an unrelated `tail -f $LS_DIR/log/...` survives) and everything in our nodes.
ls_all_pids() {
  local p comm
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    { read -r comm <"/proc/$p/comm"; } 2>/dev/null || continue
    case $comm in
      munged|mariadbd|mysqld|slurmdbd|slurmctld|slurmscriptd|slurmd|slurmstepd)
        ls_running "$p" && ls_is_ours "$p" && echo "$p" ;;
    esac
  done
  ls_node_pids
  return 0
}

# Start the slurmd of node $1. Each node gets its own UTS + mount namespace: hostname
# nodeK and a bind-mounted hosts file. Propagation is private, so the bind mount never
# reaches the host's namespace; job steps forked by this slurmd inherit both namespaces.
# The namespace id is recorded so down.sh / node.sh can find every process left on the
# node. slurmd daemonizes (setsid + fork), so it outlives the caller.
ls_start_node() {
  local n=$1
  # shellcheck disable=SC2016  # $1..$4: the inner sh's arguments, expanded there
  setsid env "$LS_TAG" unshare --uts --mount --propagation private sh -c '
      hostname "$1" && mount --bind "$2" /etc/hosts || exit 1
      echo "$1 $(readlink /proc/self/ns/uts)" >"$3"
      exec slurmd -N "$1" -f "$4"' sh "$n" "$LS_ETC/hosts-$n" "$LS_RUN/$n.uts" "$SLURM_CONF" \
    </dev/null >>"$LS_LOG/slurmd-$n.log" 2>&1 9>&- || ls_die "slurmd $n did not start" "$LS_LOG/slurmd-$n.log"
}

# Pids of every process inside node $1's namespace (its slurmd, slurmstepd, tasks).
ls_pids_of_node() {
  local p ns id
  id=$(awk '{print $2}' "$LS_RUN/$1.uts" 2>/dev/null) || return 0
  [ -n "$id" ] || return 0
  find /proc/[0-9]*/ns/uts -maxdepth 0 -printf '%p %l\n' 2>/dev/null | while read -r p ns; do
    [ "$ns" = "$id" ] || continue
    p=${p#/proc/}; p=${p%%/*}
    ls_running "$p" && echo "$p"
  done
  return 0
}

# True if PID exists and is not a zombie. Our daemons are orphans whose parent is PID 1,
# and PID 1 here (a VM agent; in a container maybe nothing) may reap them late or
# never: a zombie answers kill -0 but is dead.
ls_running() {
  local stat
  { read -r stat <"/proc/$1/stat"; } 2>/dev/null || return 1
  stat=${stat##*) }          # fields after "(comm) "; the first is the state
  [ "${stat%% *}" != Z ]
}

# Wait up to $2 whole seconds for all pids in $1 (space separated) to exit.
ls_wait_gone() {
  local pids=$1 deadline p left
  deadline=$(( $(date +%s%N) + $2 * 1000000000 ))
  while :; do
    left=
    for p in $pids; do ls_running "$p" && left+="$p "; done
    [ -z "$left" ] && return 0
    [ "$(date +%s%N)" -ge "$deadline" ] && return 1
    sleep 0.1
  done
}

# Unix time in milliseconds, for the timings we report.
ls_now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
