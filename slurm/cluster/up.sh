#!/usr/bin/env bash
# Start a real local Slurm cluster (22.05, Debian packages) with accounting:
#   munged -> MariaDB -> slurmdbd -> slurmctld + 4 slurmd (node1..node4).
# Idempotent: a running instance is stopped and its state wiped first. Waits until
# sinfo shows all nodes idle and sacct answers; on failure exits 1 with a one-line
# reason and the tail of the relevant log. All state: ${LOCALSLURM_DIR:-/tmp/localslurm}.
set -euo pipefail
# shellcheck source=common.sh source-path=SCRIPTDIR
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

t0=$(ls_now_ms)
for b in munged mariadbd mariadb-install-db slurmdbd slurmctld slurmd sinfo sacct sacctmgr unshare nsenter; do
  command -v "$b" >/dev/null || ls_die "$b not found (Debian packages missing: bash slurm/cluster/install-deps.sh)"
done
# Per-node UTS/mount namespaces need root with CAP_SYS_ADMIN (a VM, or a privileged container).
unshare --uts --mount true 2>/dev/null || ls_die "cannot create namespaces (unshare --uts --mount): need root with CAP_SYS_ADMIN"

# ---- 1. stop a previous instance, wipe its state --------------------------------------
bash "$LS_SCRIPTS/down.sh" >/dev/null
case $LS_DIR in /|/tmp|/root|/home|/var|/etc|/usr) ls_die "LOCALSLURM_DIR=$LS_DIR is not a private directory" ;; esac
if [ -d "$LS_DIR" ] && [ ! -e "$LS_MARKER" ] && [ -n "$(ls -A "$LS_DIR")" ]; then
  ls_die "$LS_DIR is not empty and was not made by up.sh (no $LS_MARKER): refusing to wipe it"
fi
rm -rf "$LS_DIR"
# From here on, a failure stops whatever did start (logs stay for inspection), so a
# failed `make test` leaves no daemons behind.
trap '[ $? -eq 0 ] || bash "$LS_SCRIPTS/down.sh" >/dev/null 2>&1' EXIT
mkdir -p "$LS_ETC" "$LS_LOG" "$LS_RUN" "$LS_MUNGE" "$LS_SPOOL/ctld" "$LS_MYSQL"
for n in "${LS_NODES[@]}"; do mkdir -p "$LS_SPOOL/$n"; done
touch "$LS_MARKER"
chmod 700 "$LS_MUNGE"
[ ${#LS_MUNGE_SOCK} -lt 100 ] || ls_die "socket path too long (${#LS_MUNGE_SOCK} chars): $LS_MUNGE_SOCK"
[ ${#LS_MYSQL_SOCK} -lt 100 ] || ls_die "socket path too long (${#LS_MYSQL_SOCK} chars): $LS_MYSQL_SOCK"

# ---- 2. MariaDB first: it is the slowest to come up, the rest renders meanwhile --------
# Own datadir, no networking, private socket, root via unix-socket auth, no system
# my.cnf (--no-defaults), so a Debian system MariaDB (if its postinst started one) is
# neither used nor disturbed. Durability is traded for speed: this DB is throwaway.
# Every daemon gets stdin/stdout/stderr redirected and fd 9 (our saved stderr) closed:
# an inherited pipe would keep a caller like `up.sh | tail` or subprocess.run() waiting.
MARIADB_OPTS=(--no-defaults --user=root --datadir="$LS_MYSQL" --socket="$LS_MYSQL_SOCK"
  --skip-networking --skip-name-resolve --skip-log-bin --performance-schema=OFF
  --innodb-buffer-pool-size=32M --innodb-log-file-size=16M
  --innodb-flush-log-at-trx-commit=0 --innodb-doublewrite=0 --innodb-flush-method=nosync
  --innodb-lock-wait-timeout=900)   # slurmdbd warns below 900
mariadb-install-db "${MARIADB_OPTS[@]}" --auth-root-authentication-method=socket --skip-test-db \
  >"$(ls_logfile mariadb-install)" 2>&1 || ls_die "mariadb-install-db failed" "$(ls_logfile mariadb-install)"
setsid env "$LS_TAG" mariadbd "${MARIADB_OPTS[@]}" --pid-file="$(ls_pidfile mariadb)" \
  --log-error="$(ls_logfile mariadb)" </dev/null >>"$(ls_logfile mariadb)" 2>&1 9>&- &
echo $! >"$(ls_pidfile mariadb)"   # now, not when mariadbd gets to it: an early death shows

# ---- 3. configs ---------------------------------------------------------------------
render() {  # render TEMPLATE DEST: fill in the @VAR@ placeholders
  sed -e "s|@CLUSTER@|$LS_CLUSTER|g" -e "s|@CTLD_HOST@|$(hostname -s)|g" \
      -e "s|@CTLD_PORT@|$LS_CTLD_PORT|g" -e "s|@DBD_PORT@|$LS_DBD_PORT|g" \
      -e "s|@MUNGE_SOCK@|$LS_MUNGE_SOCK|g" -e "s|@MYSQL_SOCK@|$LS_MYSQL_SOCK|g" \
      -e "s|@ETC@|$LS_ETC|g" -e "s|@SPOOL@|$LS_SPOOL|g" -e "s|@LOG@|$LS_LOG|g" -e "s|@RUN@|$LS_RUN|g" \
      "$LS_SCRIPTS/templates/$1" >"$2"
}
render slurm.conf.in "$SLURM_CONF"
# UnkillableStepProgram: what ran when a step outlived SIGKILL, into log/unkillable.log
cat >"$LS_ETC/unkillable.sh" <<SCRIPT
#!/bin/sh
{ date -u +%FT%TZ; echo "job \${SLURM_JOB_ID:-?} step \${SLURM_STEP_ID:-?} on \${SLURMD_NODENAME:-?}"
  ps -eo pid,ppid,pgid,stat,wchan:24,etime,args; } >>"$LS_LOG/unkillable.log" 2>&1
SCRIPT
chmod +x "$LS_ETC/unkillable.sh"
{
  echo "# Compute nodes: one slurmd each on 127.0.0.1, distinct ports (slurmd -N nodeK)."
  echo "# Features pair1 (node1-2), pair2 (node3-4): two test runs share the cluster side by"
  echo "# side, each confined to its pair by SBATCH_CONSTRAINT (tests/run_suite.sh)."
  for i in "${!LS_NODES[@]}"; do
    n=${LS_NODES[$i]}
    echo "NodeName=$n NodeHostname=$n NodeAddr=127.0.0.1 Port=$((LS_SLURMD_PORT0 + i))" \
         "CPUs=$LS_NODE_CPUS RealMemory=$LS_NODE_MEM Features=pair$((i / 2 + 1)) State=UNKNOWN"
  done
  all="node[1-${#LS_NODES[@]}]"
  echo "# Same nodes, two tiers: jobs in high preempt (requeue) jobs in debug."
  echo "PartitionName=debug Nodes=$all Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=15 MaxTime=INFINITE State=UP"
  echo "PartitionName=high Nodes=$all PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP"
} >>"$SLURM_CONF"
: >"$LS_ETC/plugstack.conf"
render slurmdbd.conf.in "$LS_ETC/slurmdbd.conf"
chmod 600 "$LS_ETC/slurmdbd.conf"   # slurmdbd refuses a readable config
# Hosts file seen inside node K: all node names (and this machine's name) resolve to
# 127.0.0.1, so rendezvous code sees real, distinct, resolvable hosts. One line per
# name (each is its own canonical name), node K first (127.0.0.1 reverse-resolves to it).
for n in "${LS_NODES[@]}"; do
  { echo "127.0.0.1 $n"; printf '127.0.0.1 %s\n' "${LS_NODES[@]}" | grep -vx "127.0.0.1 $n"
    cat /etc/hosts; echo "127.0.0.1 localhost $(hostname)"; } >"$LS_ETC/hosts-$n"
done

# ---- 4. munged with its own key and socket --------------------------------------------
dd if=/dev/urandom of="$LS_MUNGE/munge.key" bs=1024 count=1 status=none
chmod 400 "$LS_MUNGE/munge.key"
env "$LS_TAG" munged --force --key-file="$LS_MUNGE/munge.key" --socket="$LS_MUNGE_SOCK" \
  --pid-file="$(ls_pidfile munged)" --log-file="$(ls_logfile munged)" \
  --seed-file="$LS_MUNGE/munged.seed" --num-threads=4 </dev/null >>"$(ls_logfile munged)" 2>&1 9>&- \
  || ls_die "munged did not start" "$(ls_logfile munged)"

# wait_for WHAT LOG DAEMON COMMAND...: poll COMMAND (quietly) until it succeeds; die
# if DAEMON (a pid-file name) has died or the deadline has passed.
deadline=$(( $(date +%s) + LS_TIMEOUT ))
wait_for() {
  local what=$1 log=$2 daemon=$3; shift 3
  until "$@" >/dev/null 2>&1; do
    if [ -n "$daemon" ] && [ -s "$(ls_pidfile "$daemon")" ] && ! ls_alive "$daemon" >/dev/null; then
      ls_die "$daemon died while waiting for $what" "$log"
    fi
    [ "$(date +%s)" -lt "$deadline" ] || ls_die "timeout (${LS_TIMEOUT}s) waiting for $what" "$log"
    sleep 0.1
  done
}
wait_for "the munge socket" "$(ls_logfile munged)" munged test -S "$LS_MUNGE_SOCK"

# ---- 5. slurmdbd (needs MariaDB), then register the cluster ---------------------------
wait_for "MariaDB's socket" "$(ls_logfile mariadb)" mariadb test -S "$LS_MYSQL_SOCK"
t_db=$(ls_now_ms)
env "$LS_TAG" MYSQL_UNIX_PORT="$LS_MYSQL_SOCK" slurmdbd </dev/null >>"$(ls_logfile slurmdbd)" 2>&1 9>&- \
  || ls_die "slurmdbd did not start" "$(ls_logfile slurmdbd)"
# First start creates the schema; sacctmgr answers once slurmdbd listens.
wait_for "slurmdbd to answer" "$(ls_logfile slurmdbd)" slurmdbd sacctmgr -n list cluster
sacctmgr -i add cluster "$LS_CLUSTER" >/dev/null 2>&1 || true
sacctmgr -n -P list cluster format=cluster | grep -qx "$LS_CLUSTER" \
  || ls_die "cluster $LS_CLUSTER not registered in slurmdbd" "$(ls_logfile slurmdbd)"
t_dbd=$(ls_now_ms)

# ---- 6. slurmctld and the compute nodes ----------------------------------------------
env "$LS_TAG" slurmctld -f "$SLURM_CONF" </dev/null >>"$(ls_logfile slurmctld)" 2>&1 9>&- \
  || ls_die "slurmctld did not start" "$(ls_logfile slurmctld)"
for n in "${LS_NODES[@]}"; do ls_start_node "$n"; done

# ---- 7. ready when all nodes are idle and sacct answers -------------------------------
nodes_idle() {
  ls_alive slurmctld >/dev/null || ls_die "slurmctld died during startup" "$(ls_logfile slurmctld)"
  local n
  for n in "${LS_NODES[@]}"; do
    ls_alive "slurmd-$n" >/dev/null || [ ! -s "$(ls_pidfile "slurmd-$n")" ] \
      || ls_die "slurmd on $n died during startup" "$LS_LOG/slurmd-$n.log"
  done
  [ "$(sinfo -h -N -p debug -o '%N %t' 2>/dev/null | grep -c ' idle$')" -eq "${#LS_NODES[@]}" ]
}
wait_for "all ${#LS_NODES[@]} nodes idle in sinfo" "$(ls_logfile slurmctld)" slurmctld nodes_idle
wait_for "sacct to answer" "$(ls_logfile slurmdbd)" slurmdbd sacct -n -X -S now
t1=$(ls_now_ms)

ls_say "up in $(( (t1 - t0) / 1000 )).$(( (t1 - t0) % 1000 / 100 ))s" \
  "(slurmdbd $(( t_dbd - t_db ))ms): ${#LS_NODES[@]} nodes idle, partitions debug* high, state in $LS_DIR"
echo "export SLURM_CONF=$SLURM_CONF" >&2
