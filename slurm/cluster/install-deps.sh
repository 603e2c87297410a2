#!/usr/bin/env bash
# Install the system packages the project needs when they are missing:
# Debian's Slurm (controller, compute daemon, client, accounting), munge, MariaDB,
# and g++ (DeepSpeed builds its CPU communication extension on first use).
set -euo pipefail

need=()
command -v slurmctld >/dev/null || need+=(slurmctld)
command -v slurmd >/dev/null || need+=(slurmd)
command -v sbatch >/dev/null || need+=(slurm-client)
command -v munged >/dev/null || need+=(munge)
command -v slurmdbd >/dev/null || need+=(slurmdbd)
command -v mariadbd >/dev/null || command -v mysqld >/dev/null || need+=(mariadb-server)
command -v g++ >/dev/null || need+=(g++)
[ ${#need[@]} -eq 0 ] && exit 0

echo "installing Debian packages: ${need[*]}" >&2
if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  SUDO=(sudo -n)
else
  echo "error: missing packages ${need[*]}; install them as root: apt-get install ${need[*]}" >&2
  exit 2
fi
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq "${need[@]}" >/dev/null
