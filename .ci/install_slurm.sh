#!/usr/bin/env bash
# System packages for the real local SLURM cluster that tests/cluster/test_slurm_cluster.py starts (munge, slurmctld,
# slurmd, the client tools, and slurmdbd + MariaDB for accounting, which submitit's sacct polling needs).
# Debian bookworm / Ubuntu; run as root or with passwordless sudo. Idempotent; about 40 s on a fresh machine.
# The packages' own system services are not started (the tests start private daemons with their own config).
set -euo pipefail

PKGS=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)

missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "install_slurm: already installed: ${PKGS[*]}"
    exit 0
fi

SUDO=()
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        echo "install_slurm: need root or passwordless sudo to install: ${missing[*]}" >&2
        exit 1
    fi
fi

# Keep the postinst scripts from starting munge/mariadb/slurm system services (invoke-rc.d and
# deb-systemd-invoke both ask policy-rc.d); removed again afterwards if we created it.
created_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee /usr/sbin/policy-rc.d >/dev/null
    "${SUDO[@]}" chmod 755 /usr/sbin/policy-rc.d
    created_policy=1
fi
cleanup() { if [ "$created_policy" = 1 ]; then "${SUDO[@]}" rm -f /usr/sbin/policy-rc.d; fi; }
trap cleanup EXIT

"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PKGS[@]}"
echo "install_slurm: installed ${PKGS[*]} ($(slurmd -V 2>/dev/null || echo 'slurmd version unknown'))"
