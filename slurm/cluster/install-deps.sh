#!/usr/bin/env bash
# Install the Debian packages a make target needs, those missing:
#   slurm: Debian's Slurm (controller, compute daemon, client, accounting), munge and
#          MariaDB: the local cluster (make cluster-up, make test);
#   build: g++ (DeepSpeed builds its CPU communication extension on first use: the tests).
# Usage: install-deps.sh [slurm] [build]   (no argument: both)
# Nothing missing: exits 0 at once. Missing, it installs them as root or with sudo; without
# either it says which command to run (or to ask an administrator) and exits 2, which
# stops that make target only: `make setup` and `make demo` never call this script.
set -euo pipefail

groups=("$@")
[ ${#groups[@]} -eq 0 ] && groups=(slurm build)
need=()
for group in "${groups[@]}"; do
  case $group in
    slurm)
      command -v slurmctld >/dev/null || need+=(slurmctld)
      command -v slurmd >/dev/null || need+=(slurmd)
      command -v sbatch >/dev/null || need+=(slurm-client)
      command -v munged >/dev/null || need+=(munge)
      command -v slurmdbd >/dev/null || need+=(slurmdbd)
      command -v mariadbd >/dev/null || command -v mysqld >/dev/null || need+=(mariadb-server)
      ;;
    build)
      command -v g++ >/dev/null || need+=(g++)
      ;;
    *)
      echo "error: install-deps.sh: unknown group '$group' (slurm, build)" >&2
      exit 2
      ;;
  esac
done
[ ${#need[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  SUDO=(sudo -n)
else
  cat >&2 <<EOF
error: this make target needs Debian packages that are missing: ${need[*]}
Installing them takes root (or sudo). Run as root, or ask an administrator to run:
    apt-get update && apt-get install -y ${need[*]}
then this make target again. (make demo needs none of them.)
EOF
  exit 2
fi
echo "installing Debian packages: ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq "${need[@]}" >/dev/null
