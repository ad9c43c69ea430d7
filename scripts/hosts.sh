#!/usr/bin/env bash
# Test "hosts" made of network namespaces on this machine, for multi-host runs with Open MPI (and
# torch.distributed): N namespaces ${prefix}0..${prefix}N-1, each with lo and one veth `eth0`
# (10.77.0.K+1/24) joined to a bridge ${prefix}br (10.77.0.254/24) in the root namespace, links
# optionally shaped (rate, delay, loss) on each host's eth0 egress. See --help.
set -Eeuo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
agent="$here/netns-agent.sh"
TAG="distca-hosts"           # ifalias marker on every interface this script makes
IFACE="eth0"                 # the host's interface inside its namespace
MAX_HOSTS=32

usage() {
  cat <<EOF
usage: scripts/hosts.sh COMMAND [ARGS] [OPTIONS]

Test hosts made of network namespaces (needs root / CAP_NET_ADMIN + CAP_SYS_ADMIN).

commands:
  up N          make N hosts (1..$MAX_HOSTS): namespaces PREFIX0..PREFIX(N-1), each with lo and
                $IFACE (SUBNET.1 .. SUBNET.N /24) on bridge PREFIXbr (SUBNET.254/24, so this
                namespace, where mpirun runs, reaches them). An existing set with the prefix is
                removed first. Writes DIR/hostfile, DIR/hosts.env, DIR/hosts.json.
                Exit 77 (CTest skip) where namespaces cannot be made here.
  down          remove every namespace named PREFIX<number> (killing what still runs in it), the
                bridge, the veth ends, and DIR's files; nothing there: succeeds quietly
  shape         set the shaping of existing hosts in place (replaces what they had):
                --rate/--delay/--loss [--host K], or --clear [--host K]
  link-down K   set host K's $IFACE down (a dropped link); link-up K: up again
  status        hosts, addresses, link state and shaping (--json: as JSON)

options:
  --prefix NAME   namespace/interface prefix (default distca-h; [A-Za-z0-9_-], at most 12 chars)
  --dir DIR       where up writes its files (default build/hosts under the repository)
  --subnet A.B.C  the hosts' /24 (default 10.77.0)
  --slots S       slots per host in the hostfile (default 2)
  --rate R        egress rate of each host, e.g. 1gbit, 200mbit
  --delay D       egress delay, e.g. 1ms, 500us
  --loss P        egress packet loss, e.g. 5%
  --host K        shape: only host K (index, address or namespace name)
  --clear         shape: remove the shaping
  --json          status: JSON
  -h, --help      this help

Shaping uses a netem qdisc on each host's $IFACE. Where the kernel has no netem
(CONFIG_NET_SCH_NETEM), --rate and --loss fall back to htb (+ a classic-BPF filter sending P% of
the packets to a class that drops them); --delay then exits 77.

With Open MPI (mpirun runs here, reaching the hosts through the bridge; scripts/netns-agent.sh,
its rsh agent, starts each host's daemon in the host's namespace, with the namespace's name as
hostname; out-of-band and MPI traffic use only the hosts' subnet, no shared memory):
  source build/hosts/hosts.env
  mpirun --allow-run-as-root --oversubscribe --bind-to none \$DISTCA_MPIRUN_HOST_FLAGS \\
    --hostfile "\$DISTCA_HOSTS_HOSTFILE" --map-by node -np 2 ./build/src/tools/distca ...
A link that drops (link-down) ends such a job in about 7 s ("ORTE has lost communication with a
remote daemon"), from the keepalive settings in the flags.

torch.distributed (gloo) on the hosts, one process per host:
  ip netns exec PREFIX0 env MASTER_ADDR=SUBNET.1 MASTER_PORT=29500 GLOO_SOCKET_IFNAME=$IFACE \\
    RANK=0 WORLD_SIZE=2 python train.py &      # and RANK=1 in PREFIX1
EOF
}

shq() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }  # a single-quoted shell word
die() { local code="$1"; shift; echo "hosts.sh: $*" >&2; exit "$code"; }
skip() { echo "hosts.sh: skipped: $*" >&2; exit 77; }

# ---- options -----------------------------------------------------------------------------------
[ $# -ge 1 ] || { usage >&2; exit 2; }
cmd="$1"; shift
case "$cmd" in
  -h|--help|help) usage; exit 0 ;;
  up|down|shape|link-down|link-up|status) ;;
  *) die 2 "unknown command '$cmd' (up, down, shape, link-down, link-up, status; --help)" ;;
esac

prefix="distca-h"; dir=""; subnet="10.77.0"; slots=2
rate=""; delay=""; loss=""; host_sel=""; clear=0; json=0
positional=()
need_arg() { [ $# -ge 2 ] && [ -n "$2" ] || die 2 "$1 needs a value"; }
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --prefix) need_arg "$@"; prefix="$2"; shift 2 ;;
    --dir) need_arg "$@"; dir="$2"; shift 2 ;;
    --subnet) need_arg "$@"; subnet="$2"; shift 2 ;;
    --slots) need_arg "$@"; slots="$2"; shift 2 ;;
    --rate) need_arg "$@"; rate="$2"; shift 2 ;;
    --delay) need_arg "$@"; delay="$2"; shift 2 ;;
    --loss) need_arg "$@"; loss="$2"; shift 2 ;;
    --host) need_arg "$@"; host_sel="$2"; shift 2 ;;
    --clear) clear=1; shift ;;
    --json) json=1; shift ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;;
    -*) die 2 "unknown option '$1' (--help)" ;;
    *) positional+=("$1"); shift ;;
  esac
done

allowed() {  # allowed OPTION-NAMES...: the options given must be among them
  local given=() o
  [ "$prefix" != "distca-h" ] && given+=(prefix)
  [ -n "$dir" ] && given+=(dir)
  [ "$subnet" != "10.77.0" ] && given+=(subnet)
  [ "$slots" != "2" ] && given+=(slots)
  [ -n "$rate" ] && given+=(rate)
  [ -n "$delay" ] && given+=(delay)
  [ -n "$loss" ] && given+=(loss)
  [ -n "$host_sel" ] && given+=(host)
  [ "$clear" = 1 ] && given+=(clear)
  [ "$json" = 1 ] && given+=(json)
  for o in ${given[@]+"${given[@]}"}; do
    case " $* " in *" $o "*) ;; *) die 2 "$cmd does not take --$o" ;; esac
  done
}
case "$cmd" in
  up) allowed prefix dir subnet slots rate delay loss ;;
  down) allowed prefix dir ;;
  shape) allowed prefix rate delay loss host clear ;;
  link-down|link-up) allowed prefix ;;
  status) allowed prefix json ;;
esac

[[ "$prefix" =~ ^[A-Za-z0-9_-]{1,12}$ ]] || die 2 "--prefix must be 1-12 characters of [A-Za-z0-9_-] (interface names are at most 15)"
[[ "$prefix" =~ [0-9]$ ]] && die 2 "--prefix must not end with a digit (host names are PREFIX<number>)"
if [[ "$subnet" =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$ ]] &&
   [ "${BASH_REMATCH[1]}" -le 255 ] && [ "${BASH_REMATCH[2]}" -le 255 ] && [ "${BASH_REMATCH[3]}" -le 255 ]; then :
else die 2 "--subnet must be the first three octets of a /24, e.g. 10.77.0 (got '$subnet')"; fi
[[ "$slots" =~ ^[1-9][0-9]{0,3}$ ]] || die 2 "--slots must be a positive integer (got '$slots')"

shopt -s nocasematch
if [ -n "$rate" ]; then
  [[ "$rate" =~ ^([0-9]+(\.[0-9]+)?)(|k|m|g|t|ki|mi|gi|ti)(bit|bps)$ ]] && [[ ! "$rate" =~ ^0+(\.0+)?[a-z] ]] ||
    die 2 "malformed --rate '$rate' (a positive number with a unit: bit kbit mbit gbit tbit, or bps kbps mbps gbps = bytes/s; e.g. 1gbit, 200mbit)"
fi
if [ -n "$delay" ]; then
  [[ "$delay" =~ ^[0-9]+(\.[0-9]+)?(s|sec|secs|ms|msec|msecs|us|usec|usecs)$ ]] ||
    die 2 "malformed --delay '$delay' (a number with a unit: s ms us; e.g. 1ms)"
fi
if [ -n "$loss" ]; then
  [[ "$loss" =~ ^([0-9]+(\.[0-9]+)?)%?$ ]] && awk -v p="${BASH_REMATCH[1]}" 'BEGIN {exit !(p <= 100)}' ||
    die 2 "malformed --loss '$loss' (a percentage 0..100, e.g. 5%)"
  loss="${loss%\%}%"
fi
shopt -u nocasematch
rate="${rate,,}"; delay="${delay,,}"

if [ -z "$dir" ]; then dir="$root/build/hosts"; fi
case "$dir" in /*) ;; *) dir="$(pwd)/$dir" ;; esac
bridge="${prefix}br"
bridge_addr="$subnet.254"

# ---- helpers -----------------------------------------------------------------------------------
list_ns() {  # this prefix's namespaces, by host number
  { ip netns list 2>/dev/null || true; } | awk '{print $1}' | { grep -E "^${prefix}[0-9]+\$" || true; } |
    awk -v p="$prefix" '{print substr($0, length(p) + 1) " " $0}' | sort -n | awk '{print $2}'
}
list_veths() {  # root-side veth ends of this prefix
  { ip -o link show 2>/dev/null || true; } | awk -F': ' '{sub(/@.*/, "", $2); print $2}' |
    { grep -E "^${prefix}v[0-9]+\$" || true; }
}
alias_of() {  # alias_of [NS] DEV
  if [ $# -eq 2 ]; then ip -n "$1" link show dev "$2" 2>/dev/null; else ip link show dev "$1" 2>/dev/null; fi |
    sed -n 's/^ *alias //p'
}
ours() {  # ours ALIAS: an alias left by this script for another prefix is not ours
  case "$1" in "") return 0 ;; "$TAG:$prefix"|"$TAG:$prefix "*) return 0 ;; "$TAG:"*) return 1 ;; *) return 1 ;; esac
}
is_root_capable() {  # CAP_NET_ADMIN (12) and CAP_SYS_ADMIN (21, for the namespace mounts) in effect
  local cap
  cap="$(awk '/^CapEff:/ {print $2}' /proc/self/status 2>/dev/null)" || return 1
  [ -n "$cap" ] || return 1
  (( (16#$cap >> 12) & 1 )) && (( (16#$cap >> 21) & 1 ))
}
have_netem() {  # probed in a throwaway namespace (unshare -n): nothing is left behind
  if [ -z "${_have_netem:-}" ]; then
    if unshare -n tc qdisc add dev lo root netem >/dev/null 2>&1; then _have_netem=1; else _have_netem=0; fi
  fi
  [ "$_have_netem" = 1 ]
}
have_htb_bpf() {
  unshare -n sh -c 'ip link add pa type veth peer name pb &&
    tc qdisc add dev pa root handle 1: htb default 10 &&
    tc filter add dev pa parent 1: protocol all prio 1 bpf bytecode "1,6 0 0 0" classid 1:20' >/dev/null 2>&1
}
check_shaping_support() {  # exit 77 when the requested shaping cannot be done on this kernel
  [ -n "$rate$delay$loss" ] || return 0
  command -v tc >/dev/null 2>&1 || skip "no 'tc' (iproute2) to shape the links"
  have_netem && return 0
  [ -z "$delay" ] || skip "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), which --delay needs (--rate and --loss work without it)"
  have_htb_bpf || skip "this kernel has neither netem nor htb + cls_bpf, which --rate/--loss need"
}
rate_bytes() {  # bytes/s of a tc rate
  awk -v r="$1" 'BEGIN {
    r = tolower(r); bytes = (r ~ /bps$/); sub(/(bit|bps)$/, "", r)
    m = 1; if (r ~ /i$/) { b = 1024; sub(/i$/, "", r) } else b = 1000
    if (r ~ /k$/) m = b; else if (r ~ /m$/) m = b^2; else if (r ~ /g$/) m = b^3; else if (r ~ /t$/) m = b^4
    sub(/[kmgt]$/, "", r); v = r * m; if (!bytes) v /= 8; printf "%.0f\n", v }'
}

apply_shape() {  # apply_shape NS: replaces the host's qdisc with the current rate/delay/loss
  local ns="$1" desc="$TAG:$prefix"
  ip netns exec "$ns" tc qdisc del dev "$IFACE" root >/dev/null 2>&1 || true
  if [ -n "$rate$delay$loss" ]; then
    if have_netem; then
      # queue: netem's 1000 packets, or twice the bandwidth-delay product (at 10gbit without --rate)
      local limit
      limit="$(awk -v b="$(rate_bytes "${rate:-10gbit}")" -v d="${delay:-0s}" 'BEGIN {
        u = d; sub(/^[0-9.]+/, "", u); v = d + 0
        s = (u ~ /^u/) ? v / 1e6 : (u ~ /^m/) ? v / 1e3 : v
        l = int(2 * b * s / 1500) + 1; print (l > 1000 ? l : 1000) }')"
      local args=(limit "$limit")
      [ -n "$delay" ] && args+=(delay "$delay")
      [ -n "$rate" ] && args+=(rate "$rate")
      [ -n "$loss" ] && args+=(loss random "$loss")
      ip netns exec "$ns" tc qdisc add dev "$IFACE" root handle 1: netem "${args[@]}"
    else  # htb: class 1:10 at the rate; loss: a cBPF filter sends P% of the packets to 1:20, whose pfifo holds 0
      local burst thr
      # Burst: one GSO packet (64 KB) and a frame, whatever the rate: a larger one lets every
      # exchange's first burst bytes through at the veth's own speed (at 1gbit, bps / 250 = 500 KB
      # made a 2 MB exchange 25 % faster than the rate), which the shaped rate must not allow.
      burst=66000
      ip netns exec "$ns" tc qdisc add dev "$IFACE" root handle 1: htb default 10
      ip netns exec "$ns" tc class add dev "$IFACE" parent 1: classid 1:10 htb rate "${rate:-100gbit}" burst "$burst" cburst "$burst" quantum 65536
      if [ -n "$loss" ]; then
        thr="$(awk -v p="${loss%\%}" 'BEGIN {t = p / 100 * 4294967296; if (t > 4294967295) t = 4294967295; printf "%.0f\n", t}')"
        ip netns exec "$ns" tc class add dev "$IFACE" parent 1: classid 1:20 htb rate 1mbit quantum 1514
        ip netns exec "$ns" tc qdisc add dev "$IFACE" parent 1:20 handle 20: pfifo limit 0
        # A = random u32; A >= thr: return 0 (no match: default class 1:10); else -1 (the filter's class 1:20)
        ip netns exec "$ns" tc filter add dev "$IFACE" parent 1: protocol all prio 1 \
          bpf bytecode "4,32 0 0 4294963256,53 1 0 $thr,6 0 0 4294967295,6 0 0 0" classid 1:20
      fi
    fi
    desc="$desc rate=${rate:--} delay=${delay:--} loss=${loss:--}"
  fi
  ip -n "$ns" link set dev "$IFACE" alias "$desc"
}

teardown() {  # removes this prefix's namespaces (and what runs in them), veths and bridge
  local ns pids v a
  for ns in $(list_ns); do
    a="$(alias_of "$ns" "$IFACE")"
    if ! ours "$a"; then echo "hosts.sh: leaving $ns alone: its $IFACE is marked '$a'" >&2; continue; fi
    pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')" || true
    if [ -n "${pids// /}" ]; then
      echo "hosts.sh: $ns: stopping what still runs there: $(ps -o pid=,comm= -p "$(echo $pids | tr ' ' ,)" 2>/dev/null | awk '{printf "%s%s(%s)", s, $2, $1; s = " "}')" >&2
      kill -TERM $pids 2>/dev/null || true
      for _ in 1 2 3 4 5 6 7 8 9 10; do
        pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')" || true
        [ -n "${pids// /}" ] || break
        sleep 0.2
      done
      [ -z "${pids// /}" ] || kill -KILL $pids 2>/dev/null || true
    fi
    ip netns del "$ns"
  done
  for v in $(list_veths); do
    a="$(alias_of "$v" || true)"  # gone already: a deleted namespace takes its veth pair along
    ours "$a" && ip link del "$v" 2>/dev/null || true
  done
  if ip link show dev "$bridge" >/dev/null 2>&1; then
    a="$(alias_of "$bridge" || true)"
    if ours "$a"; then ip link del "$bridge"; else echo "hosts.sh: leaving $bridge alone: marked '$a'" >&2; fi
  fi
}

resolve_host() {  # resolve_host SEL: prints the namespace of host SEL (index, address or name)
  local sel="$1" ns
  if [[ "$sel" =~ ^[0-9]+$ ]]; then
    ns="$prefix$((10#$sel))"
  elif [[ "$sel" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
    for ns in $(list_ns); do
      [ "$(host_addr "$ns")" = "$sel" ] && { echo "$ns"; return 0; }
    done
    die 1 "no host of prefix $prefix has address $sel"
  else
    ns="$sel"
  fi
  list_ns | grep -qx -- "$ns" || die 1 "no host '$sel' (namespace $ns) of prefix $prefix (scripts/hosts.sh status)"
  echo "$ns"
}
host_addr() { ip -n "$1" -o -4 addr show dev "$IFACE" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}'; }
host_link() { if ip -n "$1" link show dev "$IFACE" 2>/dev/null | head -1 | grep -q '<[^>]*\bUP\b'; then echo up; else echo down; fi; }
host_qdisc() { ip netns exec "$1" tc qdisc show dev "$IFACE" root 2>/dev/null | head -1 | sed 's/^qdisc //; s/ root refcnt [0-9]*//; s/ *$//'; }
host_shape() {  # prints "rate delay loss" from the alias ('-' for none)
  local a; a="$(alias_of "$1" "$IFACE")"
  echo "$a" | awk '{r = "-"; d = "-"; l = "-"; for (i = 2; i <= NF; i++) { split($i, kv, "=");
    if (kv[1] == "rate") r = kv[2]; if (kv[1] == "delay") d = kv[2]; if (kv[1] == "loss") l = kv[2] } print r, d, l}'
}
jstr() { if [ "$1" = "-" ] || [ -z "$1" ]; then printf null; else printf '"%s"' "$(printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g')"; fi; }

mpirun_flags() {
  # routed direct: every daemon talks to mpirun itself. (No plm_rsh_no_tree_spawn: with it Open MPI
  # starts the daemons with --daemonize, so a daemon that cannot reach mpirun goes unnoticed and
  # mpirun waits forever, and a daemon outlives a killed mpirun.)
  printf '%s' "--mca plm rsh --mca plm_rsh_agent $agent --mca routed direct"
  printf '%s' " --mca oob tcp --mca oob_tcp_if_include $subnet.0/24"
  # a daemon whose link drops is declared lost after 5 s idle + 5 unanswered probes 1 s apart, and
  # the job ends (without this, mpirun waits on TCP retransmissions for many minutes)
  printf '%s' " --mca oob_tcp_keepalive_time 5 --mca oob_tcp_keepalive_intvl 1 --mca oob_tcp_keepalive_probes 5"
  printf '%s' " --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include $subnet.0/24 --mca osc ^ucx"
}

need_root() {
  command -v ip >/dev/null 2>&1 || die 1 "no 'ip' (iproute2)"
  is_root_capable || die 1 "$cmd needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
}

# ---- commands ----------------------------------------------------------------------------------
case "$cmd" in
up)
  [ ${#positional[@]} -eq 1 ] || die 2 "up takes one argument N (the number of hosts, 1..$MAX_HOSTS)"
  n="${positional[0]}"
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$((10#$n))" -ge 1 ] && [ "$((10#$n))" -le "$MAX_HOSTS" ] ||
    die 2 "N must be a positive integer <= $MAX_HOSTS (got '$n')"
  n=$((10#$n))
  # Can namespaces be made here? Checked without making anything (exit 77 if not).
  command -v ip >/dev/null 2>&1 || skip "no 'ip' (iproute2) on this machine"
  is_root_capable || skip "making network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); running as uid $(id -u) without them"
  ip netns list >/dev/null 2>&1 || skip "'ip netns' does not work here: $(ip netns list 2>&1 | head -1)"
  command -v unshare >/dev/null 2>&1 || skip "no 'unshare' (util-linux) to check namespace support"
  probe_err="$(unshare -n sh -c 'ip link add pa type veth peer name pb && ip link add pbr type bridge && ip link set pa master pbr' 2>&1)" ||
    skip "this kernel/container cannot make veth pairs and bridges in a network namespace: ${probe_err:-unshare -n failed}"
  check_shaping_support

  teardown  # an existing set with this prefix: made anew
  if ip -o -4 route show to "$subnet.0/24" 2>/dev/null | grep -q .; then
    die 1 "subnet $subnet.0/24 is already routed here ($(ip -o -4 route show to "$subnet.0/24" | head -1)): choose another --subnet"
  fi

  # shellcheck disable=SC2154  # rc is set inside the trap
  trap 'rc=$?; trap - ERR; echo "hosts.sh: up failed (line $LINENO, exit $rc); removing what it made" >&2; teardown || true; exit 1' ERR
  ip link add "$bridge" type bridge
  ip link set dev "$bridge" alias "$TAG:$prefix"
  ip addr add "$bridge_addr/24" dev "$bridge"
  ip link set dev "$bridge" up
  for ((k = 0; k < n; k++)); do
    ns="$prefix$k"; veth="${prefix}v$k"
    ip netns add "$ns"
    ip -n "$ns" link set dev lo up
    ip link add "$veth" type veth peer name "$IFACE" netns "$ns"
    ip link set dev "$veth" alias "$TAG:$prefix"
    ip -n "$ns" link set dev "$IFACE" alias "$TAG:$prefix"
    ip link set dev "$veth" master "$bridge"
    ip link set dev "$veth" up
    ip -n "$ns" addr add "$subnet.$((k + 1))/24" dev "$IFACE"
    ip -n "$ns" link set dev "$IFACE" up
    apply_shape "$ns"
  done

  mkdir -p "$dir"
  flags="$(mpirun_flags)"
  addrs=(); nss=()
  for ((k = 0; k < n; k++)); do addrs+=("$subnet.$((k + 1))"); nss+=("$prefix$k"); done
  : > "$dir/hostfile"
  for a in "${addrs[@]}"; do echo "$a slots=$slots" >> "$dir/hostfile"; done
  {
    echo "# written by scripts/hosts.sh up (source it; scripts/hosts.sh down removes it)"
    echo "DISTCA_HOSTS_PREFIX=$(shq "$prefix")"
    echo "DISTCA_HOSTS_N=$(shq "$n")"
    echo "DISTCA_HOSTS_SUBNET=$(shq "$subnet")"
    echo "DISTCA_HOSTS_ADDRS=$(shq "${addrs[*]}")"
    echo "DISTCA_HOSTS_NAMESPACES=$(shq "${nss[*]}")"
    echo "DISTCA_HOSTS_IFACE=$(shq "$IFACE")"
    echo "DISTCA_HOSTS_BRIDGE=$(shq "$bridge")"
    echo "DISTCA_HOSTS_BRIDGE_ADDR=$(shq "$bridge_addr")"
    echo "DISTCA_HOSTS_SLOTS=$(shq "$slots")"
    echo "DISTCA_HOSTS_HOSTFILE=$(shq "$dir/hostfile")"
    echo "DISTCA_HOSTS_RATE=$(shq "$rate")"
    echo "DISTCA_HOSTS_DELAY=$(shq "$delay")"
    echo "DISTCA_HOSTS_LOSS=$(shq "$loss")"
    echo "DISTCA_HOSTS_AGENT=$(shq "$agent")"
    echo "# mpirun \$DISTCA_MPIRUN_HOST_FLAGS --hostfile \"\$DISTCA_HOSTS_HOSTFILE\" ... (unquoted: one word per flag)"
    echo "DISTCA_MPIRUN_HOST_FLAGS=$(shq "$flags")"
  } > "$dir/hosts.env"
  {
    printf '{\n  "prefix": %s,\n  "n": %d,\n  "subnet": %s,\n  "interface": %s,\n' "$(jstr "$prefix")" "$n" "$(jstr "$subnet")" "$(jstr "$IFACE")"
    printf '  "bridge": %s,\n  "bridge_addr": %s,\n  "slots": %d,\n' "$(jstr "$bridge")" "$(jstr "$bridge_addr")" "$slots"
    printf '  "hostfile": %s,\n  "agent": %s,\n' "$(jstr "$dir/hostfile")" "$(jstr "$agent")"
    printf '  "shaping": {"rate": %s, "delay": %s, "loss": %s, "qdisc": %s},\n' "$(jstr "$rate")" "$(jstr "$delay")" "$(jstr "$loss")" \
      "$(if [ -z "$rate$delay$loss" ]; then jstr ""; elif have_netem; then jstr netem; else jstr htb; fi)"
    printf '  "hosts": [\n'
    for ((k = 0; k < n; k++)); do
      printf '    {"index": %d, "namespace": %s, "addr": %s, "slots": %d}%s\n' "$k" "$(jstr "${nss[k]}")" "$(jstr "${addrs[k]}")" "$slots" \
        "$([ $k -lt $((n - 1)) ] && echo ,)"
    done
    printf '  ],\n  "mpirun_host_flags": %s\n}\n' "$(jstr "$flags")"
  } > "$dir/hosts.json"
  trap - ERR
  echo "hosts.sh: $n hosts up: ${nss[*]} (${addrs[*]}) on $bridge ($bridge_addr)$([ -n "$rate$delay$loss" ] && echo ", shaped: rate=${rate:--} delay=${delay:--} loss=${loss:--}"); files in $dir"
  ;;

down)
  [ ${#positional[@]} -eq 0 ] || die 2 "down takes no arguments"
  command -v ip >/dev/null 2>&1 || exit 0
  if [ -n "$(list_ns)$(list_veths)" ] || ip link show dev "$bridge" >/dev/null 2>&1; then
    is_root_capable || die 1 "down needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    teardown
  fi
  if [ -f "$dir/hosts.env" ]; then
    if grep -qx "DISTCA_HOSTS_PREFIX=$(shq "$prefix")" "$dir/hosts.env"; then
      rm -f "$dir/hostfile" "$dir/hosts.env" "$dir/hosts.json"
      rmdir "$dir" 2>/dev/null || true
    fi
  fi
  ;;

shape)
  [ ${#positional[@]} -eq 0 ] || die 2 "shape takes no arguments (--host K for one host)"
  if [ "$clear" = 1 ]; then
    [ -z "$rate$delay$loss" ] || die 2 "shape: --clear with --rate/--delay/--loss"
  else
    [ -n "$rate$delay$loss" ] || die 2 "shape: give --rate, --delay and/or --loss, or --clear"
  fi
  need_root
  [ -n "$(list_ns)" ] || die 1 "no hosts of prefix $prefix (scripts/hosts.sh up N)"
  check_shaping_support
  if [ -n "$host_sel" ]; then targets="$(resolve_host "$host_sel")"; else targets="$(list_ns)"; fi
  for ns in $targets; do apply_shape "$ns"; done
  ;;

link-down|link-up)
  [ ${#positional[@]} -eq 1 ] || die 2 "$cmd takes one argument K (host index, address or namespace)"
  need_root
  ns="$(resolve_host "${positional[0]}")"
  ip -n "$ns" link set dev "$IFACE" "${cmd#link-}"
  echo "hosts.sh: $ns ($(host_addr "$ns")) $IFACE ${cmd#link-}"
  ;;

status)
  [ ${#positional[@]} -eq 0 ] || die 2 "status takes no arguments"
  command -v ip >/dev/null 2>&1 || die 1 "no 'ip' (iproute2)"
  mapfile -t nss < <(list_ns)
  baddr="$(ip -o -4 addr show dev "$bridge" 2>/dev/null | awk '{print $4; exit}')" || true
  if [ "$json" = 1 ]; then
    printf '{"prefix": %s, "n": %d, "bridge": %s, "bridge_addr": %s, "hosts": [' "$(jstr "$prefix")" "${#nss[@]}" \
      "$(if [ -n "$baddr" ]; then jstr "$bridge"; else jstr ""; fi)" "$(jstr "${baddr%/*}")"
    sep=""
    for ns in ${nss[@]+"${nss[@]}"}; do
      read -r r d l <<< "$(host_shape "$ns")"
      printf '%s\n  {"index": %s, "namespace": %s, "addr": %s, "link": %s, "rate": %s, "delay": %s, "loss": %s, "qdisc": %s}' "$sep" \
        "${ns#"$prefix"}" "$(jstr "$ns")" "$(jstr "$(host_addr "$ns")")" "$(jstr "$(host_link "$ns")")" \
        "$(jstr "$r")" "$(jstr "$d")" "$(jstr "$l")" "$(jstr "$(host_qdisc "$ns")")"
      sep=","
    done
    printf '%s]}\n' "$([ -n "$sep" ] && echo $'\n')"
  else
    if [ ${#nss[@]} -eq 0 ]; then echo "no hosts of prefix $prefix"; exit 0; fi
    echo "${#nss[@]} hosts of prefix $prefix on bridge $bridge (${baddr:-no address})"
    printf '%-5s %-16s %-15s %-5s %-9s %-7s %-7s %s\n' HOST NAMESPACE ADDRESS LINK RATE DELAY LOSS QDISC
    for ns in "${nss[@]}"; do
      read -r r d l <<< "$(host_shape "$ns")"
      printf '%-5s %-16s %-15s %-5s %-9s %-7s %-7s %s\n' "${ns#"$prefix"}" "$ns" "$(host_addr "$ns")" "$(host_link "$ns")" \
        "$r" "$d" "$l" "$(host_qdisc "$ns")"
    done
  fi
  ;;
esac
