#!/usr/bin/env bash
# System packages the test suite uses: libaio-dev for DeepSpeed's async I/O op (ZeRO-Infinity NVMe
# offload); openssh-server and openssh-client for `shardkit launch --hostfile`, tested against an sshd the test
# starts on loopback. Installed when we are root and apt-get exists; otherwise the tests that need them say what is
# missing and skip.
set -euo pipefail
missing=()
[ -e /usr/include/libaio.h ] || missing+=(libaio-dev)
{ command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ]; } || missing+=(openssh-server)
command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
if [ "${#missing[@]}" = "0" ]; then exit 0; fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${missing[*]} (DeepSpeed async I/O for NVMe offload; ssh for the hostfile launcher's tests)"
    (apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null; })
else
    echo "note: ${missing[*]} missing and cannot be installed here (need root + apt-get); NVMe offload / ssh launch tests will skip" >&2
fi
