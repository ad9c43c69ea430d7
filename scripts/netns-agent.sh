#!/usr/bin/env bash
# Open MPI's "remote shell" for the test hosts of scripts/hosts.py (network namespaces on this
# machine): mpirun --mca plm_rsh_agent /abs/path/scripts/netns-agent.sh ... (hosts.env's
# DISTCA_MPIRUN_HOST_FLAGS has it). Open MPI calls it as it would call ssh:
#   netns-agent.sh [ssh options...] HOST command words...
# HOST (an address of a host's eth0, [user@]address, a name that resolves to one, or a namespace
# name) is mapped to its namespace, and the command words, joined with spaces as ssh joins them,
# run there under `ip netns exec NS sh -c "..."`, so the remote shell sees the same text ssh's
# would, with the namespace's name as hostname. Needs root. Exit 255 (as ssh) when HOST is no
# namespace's.
set -euo pipefail

die() { echo "netns-agent: $*" >&2; exit 255; }

# ssh-style options before the host: skip them (and the argument of those that take one).
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; break ;;
    -[BbcDEeFIiJLlmOopQRSWw]) [ $# -ge 2 ] || die "option $1 needs an argument"; shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || die "usage: netns-agent.sh [ssh options] HOST [command...]"
host="${1#*@}"; shift

ns_of_addr() {  # prints the namespace whose interfaces hold IPv4 address $1
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    if [ -n "${DISTCA_HOSTS_PREFIX:-}" ]; then
      case "$ns" in "$DISTCA_HOSTS_PREFIX"[0-9]*) ;; *) continue ;; esac
    fi
    if ip -n "$ns" -o -4 addr show 2>/dev/null | awk -v a="$1" '{split($4, p, "/"); if (p[1] == a) f = 1} END {exit !f}'; then
      echo "$ns"; return 0
    fi
  done
  return 1
}

ns=""
if ip netns list 2>/dev/null | awk -v h="$host" '$1 == h {f = 1} END {exit !f}'; then
  ns="$host"                      # a namespace's own name
elif [[ "$host" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  ns="$(ns_of_addr "$host")" || die "no network namespace has address $host (scripts/hosts.py up?)"
else
  addr="$(getent ahostsv4 "$host" 2>/dev/null | awk 'NR == 1 {print $1}')" || true
  [ -n "$addr" ] || die "cannot resolve host '$host'"
  ns="$(ns_of_addr "$addr")" || die "no network namespace has address $addr ($host)"
fi

# Each host also gets its own hostname (a UTS namespace named as its network namespace): all the
# namespaces share this machine's hostname and /tmp, and Open MPI names its session directories
# /tmp/ompi.HOSTNAME.UID/..., which daemons of different hosts then race to create.
IFS=' '
cmd="${*:-sh}"
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$ns" "$cmd"
