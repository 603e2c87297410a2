#!/usr/bin/env bash
# Print the one line that points Slurm clients at the local cluster:
#   eval "$(slurm/cluster/env.sh)"
set -euo pipefail
# shellcheck source=common.sh source-path=SCRIPTDIR
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
printf 'export SLURM_CONF=%q\n' "$SLURM_CONF"
