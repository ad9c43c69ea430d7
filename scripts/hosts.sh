#!/usr/bin/env bash
# Test "hosts" made of network namespaces on this machine, for multi-host runs with Open MPI (and
# torch.distributed): N namespaces ${prefix}0..${prefix}N-1, each with lo and one veth `eth0`
# (10.77.0.K+1/24) joined to a bridge ${prefix}br (10.77.0.254/24) in the root namespace, links
# optionally shaped (rate, delay, loss) on each host's eth0 egress. See --help.
#
# What up makes is recorded, item by item as it is made, in /run/distca-hosts/PREFIX/state, and
# marked: every link it makes and each namespace's lo carry the alias distca-hosts:PREFIX:TOKEN
# (TOKEN: random, one per up). down, shape, link-down/up and status touch only what is recorded
# there and still carries the mark (for a namespace: its inode too; for a link: its ifindex too):
# never a namespace, link or process they did not make, whatever its name.
set -Eeuo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
agent="$here/netns-agent.sh"
TAG="distca-hosts"           # the alias marker (TAG:PREFIX:TOKEN) on every interface this script makes
STATE_ROOT="/run/distca-hosts"  # PREFIX/state: what up made (tmpfs, like the namespaces: gone at reboot)
STATE_FORMAT="distca-hosts-state 1"
NETNS_DIR="/var/run/netns"   # where `ip netns` keeps its names
IFACE="eth0"                 # the host's interface inside its namespace
MAX_HOSTS=32

usage() {
  cat <<EOF
usage: scripts/hosts.sh COMMAND [ARGS] [OPTIONS]

Test hosts made of network namespaces (needs root / CAP_NET_ADMIN + CAP_SYS_ADMIN).

commands:
  up N          make N hosts (1..$MAX_HOSTS): namespaces PREFIX0..PREFIX(N-1), each with lo and
                $IFACE (SUBNET.1 .. SUBNET.N /24) on bridge PREFIXbr (SUBNET.254/24, so this
                namespace, where mpirun runs, reaches them). Records each thing it makes in
                $STATE_ROOT/PREFIX/state and marks it: the alias
                $TAG:PREFIX:TOKEN on every link and on each namespace's lo. A set
                that up made with the prefix is removed first; a namespace or link with one of
                the names that up did not make is left alone, and up stops (exit 1). Writes
                DIR/hostfile, DIR/hosts.env, DIR/hosts.json. Exit 77 (CTest skip) where
                namespaces cannot be made here.
  down          remove exactly what up recorded and marked for the prefix: its namespaces
                (stopping what still runs in them), veth pairs, bridge (and the bridge's route),
                and DIR's files. Nothing else is touched, even with the prefix's names. A
                recorded thing that is already gone (deleted by hand) or cannot be removed:
                down removes the rest, prints one line for each, and exits 1. Nothing recorded:
                succeeds quietly.
  shape         set the shaping of existing hosts in place (replaces what they had):
                --rate/--delay/--loss [--host K], or --clear [--host K]
  link-down K   set host K's $IFACE down (a dropped link); link-up K: up again
  status        hosts, addresses, link state and shaping (--json: as JSON)

options:
  --prefix NAME   namespace/interface prefix (default distca-h; [A-Za-z0-9_-], at most 12 chars,
                  not starting with '-' nor ending with a digit)
  --dir DIR       where up writes its files (default build/hosts under the repository; down:
                  the one up recorded)
  --subnet A.B.C  the hosts' /24: three decimal octets 0..255 without leading zeros, inside
                  10/8, 172.16/12 or 192.168/16 (default 10.77.0)
  --slots S       slots per host in the hostfile (1..9999, default 2)
  --rate R        egress rate of each host, e.g. 1gbit, 200mbit
  --delay D       egress delay, e.g. 1ms, 500us
  --loss P        egress packet loss, e.g. 5%
  --host K        shape: only host K (index, address or namespace name)
  --clear         shape: remove the shaping
  --json          status: JSON
  -h, --help      this help

Every argument is checked before anything is made: a bad one is one line on stderr, exit 2.

Shaping uses a netem qdisc on each host's $IFACE. Where the kernel has no netem
(CONFIG_NET_SCH_NETEM), --rate and --loss fall back to htb (+ a classic-BPF filter sending P% of
the packets to a class that drops them); --delay then exits 77.

With Open MPI (mpirun runs here, reaching the hosts through the bridge; scripts/netns-agent.sh,
its rsh agent, starts each host's daemon in the host's namespace, with the namespace's name as
hostname; out-of-band and MPI traffic use only the hosts' subnet, no shared memory):
  source build/hosts/hosts.env
  mpirun --allow-run-as-root --oversubscribe --bind-to none \$DISTCA_MPIRUN_HOST_FLAGS \\
    --hostfile "\$DISTCA_HOSTS_HOSTFILE" --map-by node -np 2 ./build/src/tools/distca ...
A link that drops (link-down) ends such a job in about 11 s ("ORTE has lost communication with a
remote daemon"), from the keepalive settings in the flags (5 s idle, then 5 probes 1 s apart).

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

prefix="distca-h"; dir=""; dir_given=0; subnet="10.77.0"; slots=2
rate=""; delay=""; loss=""; host_sel=""; clear=0; json=0
positional=()
need_arg() { [ $# -ge 2 ] && [ -n "$2" ] || die 2 "$1 needs a value"; }
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --prefix) need_arg "$@"; prefix="$2"; shift 2 ;;
    --dir) need_arg "$@"; dir="$2"; dir_given=1; shift 2 ;;
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
  [ "$dir_given" = 1 ] && given+=(dir)
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

# ---- every argument checked here, before anything is made (exit 2, one line) ------------------
[[ "$prefix" =~ ^[A-Za-z0-9_][A-Za-z0-9_-]{0,11}$ ]] || die 2 "--prefix must be 1-12 characters of [A-Za-z0-9_-], not starting with '-' (interface names are at most 15; got '$prefix')"
[[ "$prefix" =~ [0-9]$ ]] && die 2 "--prefix must not end with a digit (host names are PREFIX<number>; got '$prefix')"
subnet_problem() {  # subnet_problem A.B.C: prints why it is no private /24 of three decimal octets; returns 1 then
  local octet='(0|[1-9][0-9]{0,2})' a b c
  if [[ ! "$1" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then echo "not three dotted decimal octets"; return 1; fi
  if [[ ! "$1" =~ ^$octet\.$octet\.$octet$ ]]; then echo "an octet with a leading zero (which iproute2 reads as octal) or of more than 3 digits"; return 1; fi
  a="${BASH_REMATCH[1]}"; b="${BASH_REMATCH[2]}"; c="${BASH_REMATCH[3]}"
  if (( a > 255 || b > 255 || c > 255 )); then echo "an octet above 255"; return 1; fi
  if ! (( a == 10 || (a == 172 && b >= 16 && b <= 31) || (a == 192 && b == 168) )); then
    echo "not inside a private range (10/8, 172.16/12, 192.168/16)"; return 1
  fi
}
why="$(subnet_problem "$subnet")" ||
  die 2 "--subnet must be the first three octets of a private /24, e.g. 10.77.0 (got '$subnet': $why)"
[[ "$slots" =~ ^[1-9][0-9]{0,3}$ ]] || die 2 "--slots must be an integer 1..9999 (got '$slots')"
if [ -n "$host_sel" ]; then
  [[ "$host_sel" =~ ^(0|[1-9][0-9]?)$ || "$host_sel" =~ ^[0-9]{1,3}(\.[0-9]{1,3}){3}$ || "$host_sel" =~ ^[A-Za-z0-9_][A-Za-z0-9_-]{0,14}$ ]] ||
    die 2 "--host must be a host's index, address or namespace name (got '$host_sel')"
fi
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
if [ "$cmd" = up ]; then  # up will mkdir -p DIR: it, or its nearest existing parent, must be a writable folder
  d="$dir"
  while [ ! -e "$d" ] && [ "$d" != / ]; do d="$(dirname "$d")"; done
  [ -d "$d" ] && [ -w "$d" ] || die 2 "--dir $dir: $d is not a writable folder"
fi
bridge="${prefix}br"
bridge_addr="$subnet.254"
state_dir="$STATE_ROOT/$prefix"
state="$state_dir/state"

# ---- the record of what up made ----------------------------------------------------------------
# $STATE_ROOT/PREFIX/state, one line per thing, appended by up as soon as the thing exists:
#   distca-hosts-state 1
#   token T               the set's mark is the alias TAG:PREFIX:T (T: 8+ hex digits)
#   subnet A.B.C
#   dir DIR               where up wrote hostfile, hosts.env, hosts.json
#   bridge NAME IFINDEX   the bridge, in this namespace
#   route CIDR DEV        the bridge address's route (it goes with the bridge)
#   netns NAME INODE      a host: its inode under $NETNS_DIR; its lo carries the mark
#   veth NAME IFINDEX NS  the root end of NS's pair; its peer is NS's $IFACE
# Something is this script's only while its record matches it and it carries the mark; an
# empty or absent alias never matches.
token=""; mark=""; st_subnet=""; st_dir=""; items=()
state_load() {  # reads the record into token, mark, st_subnet, st_dir, items; returns 1 where there is none
  token=""; mark=""; st_subnet=""; st_dir=""; items=()
  [ -f "$state" ] || return 1
  local line="" kind rest
  { IFS= read -r line || true; } < "$state"
  [ "$line" = "$STATE_FORMAT" ] ||
    die 1 "$state is not a '$STATE_FORMAT' record (its first line: '$line'): remove by hand what it lists, then $state_dir"
  while IFS= read -r line; do
    kind="${line%% *}"; rest="${line#* }"
    case "$kind" in
      token) token="$rest" ;;
      subnet) st_subnet="$rest" ;;
      dir) st_dir="$rest" ;;
      bridge|route|netns|veth) items+=("$line") ;;
    esac
  done < <(tail -n +2 "$state")
  [[ "$token" =~ ^[0-9a-f]{8,}$ ]] ||
    die 1 "$state has no valid token line: remove by hand what it lists, then $state_dir"
  mark="$TAG:$prefix:$token"
}
state_add() { printf '%s\n' "$*" >> "$state"; }  # state_add KIND NAME ...: one line of the record

link_info() {  # link_info [NS] DEV: prints "IFINDEX MARK" (MARK: the alias's first word, '-' for none); nothing if DEV is absent
  local out
  if [ $# -eq 2 ]; then out="$(ip -n "$1" link show dev "$2" 2>/dev/null)" || return 0
  else out="$(ip link show dev "$1" 2>/dev/null)" || return 0; fi
  printf '%s\n' "$out" | awk 'NR == 1 {i = $1 + 0} /^ +alias / {a = $2} END {print i, (a == "" ? "-" : a)}'
}
link_ours() {  # link_ours NAME IFINDEX: the link NAME is the one up recorded and carries the mark
  local i a
  read -r i a <<< "$(link_info "$1")"
  [ -n "$mark" ] && [ "$i" = "$2" ] && [ "$a" = "$mark" ]
}
netns_inode() { stat -L -c %i "$NETNS_DIR/$1" 2>/dev/null || true; }
netns_ours() {  # netns_ours NAME INODE: the namespace NAME is the one up recorded and its lo carries the mark
  local i a
  [ -n "$mark" ] && [ "$(netns_inode "$1")" = "$2" ] || return 1
  read -r i a <<< "$(link_info "$1" lo)"
  [ "$a" = "$mark" ]
}
netns_pids() {  # netns_pids INODE: the processes in the network namespace of that inode, named or not
  { ls -l /proc/[0-9]*/ns/net 2>/dev/null || true; } |
    awk -v n="net:[$1]" '$NF == n {split($(NF - 2), p, "/"); print p[3]}'
}
pids_marked() {  # pids_marked PIDS...: those whose namespace's lo carries the mark (a namespace deleted by hand, kept by its processes)
  local p i a
  for p in "$@"; do
    read -r i a <<< "$(nsenter -t "$p" -n ip link show dev lo 2>/dev/null | awk 'NR == 1 {i = $1 + 0} /^ +alias / {a = $2} END {print i, (a == "" ? "-" : a)}' || true)"
    [ "$a" = "$mark" ] && echo "$p"
  done
  return 0
}
stop_pids() {  # stop_pids WHERE INODE PIDS...: TERM, then KILL after 2 s, what runs in the namespace of INODE
  local where="$1" ino="$2" pids
  shift 2
  pids=("$@")
  [ ${#pids[@]} -gt 0 ] || return 0
  echo "hosts.sh: $where: stopping what still runs there: $(IFS=,; ps -o pid=,comm= -p "${pids[*]}" 2>/dev/null | awk '{printf "%s%s(%s)", s, $2, $1; s = " "}')" >&2
  kill -TERM "${pids[@]}" 2>/dev/null || true
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    mapfile -t pids < <(netns_pids "$ino")
    [ ${#pids[@]} -gt 0 ] || return 0
    sleep 0.2
  done
  kill -KILL "${pids[@]}" 2>/dev/null || true
}

item_state() {  # item_state LINE: ours (recorded and marked), gone, or other (its name now holds something up did not make)
  local kind name id extra
  read -r kind name id extra <<< "$1"
  case "$kind" in
    netns)
      if [ ! -e "$NETNS_DIR/$name" ]; then echo gone; elif netns_ours "$name" "$id"; then echo ours; else echo other; fi ;;
    bridge|veth)
      if ! ip link show dev "$name" >/dev/null 2>&1; then echo gone; elif link_ours "$name" "$id"; then echo ours; else echo other; fi ;;
    route)  # the route is the recorded bridge's while that bridge is
      if [ "$(item_state "$(printf '%s\n' "${items[@]}" | awk '$1 == "bridge"' | head -1)")" != ours ]; then
        if ip link show dev "$id" >/dev/null 2>&1; then echo other; else echo gone; fi
      elif ip -o -4 route show to "$name" dev "$id" 2>/dev/null | grep -q .; then echo ours
      else echo gone; fi ;;
    *) echo other ;;
  esac
}
item_name() {  # item_name LINE: how the messages name it
  local kind name id extra
  read -r kind name id extra <<< "$1"
  case "$kind" in
    netns) echo "namespace $name" ;;
    bridge) echo "bridge $name" ;;
    veth) echo "veth pair $name / $extra's $IFACE" ;;
    route) echo "route $name dev $id" ;;
  esac
}

hosts=()  # this prefix's hosts: the namespaces of the record that are still up's, by host number
hosts_load() {
  hosts=()
  state_load || return 0
  local line kind name id extra
  for line in "${items[@]}"; do
    read -r kind name id extra <<< "$line"
    [ "$kind" = netns ] && netns_ours "$name" "$id" && hosts+=("$name")
  done
  return 0
}
# ---- helpers -----------------------------------------------------------------------------------
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
  local ns="$1" desc="$mark"
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

problems=0  # set by teardown: recorded things already gone, left alone, or left
teardown() {  # removes what the record lists and is still this script's; one line on stderr for each thing
              # that was already gone, is held by something else, or could not be removed (kept in the record)
  problems=0
  state_load || return 0
  local i line kind name id extra now pids=() left=() before=()
  # 1. What is there, before anything is removed: what is missing now went outside this script.
  for i in "${!items[@]}"; do before[i]="$(item_state "${items[i]}")"; done
  # 2. The namespaces, with what runs in them. A recorded namespace deleted by hand lives on while
  #    a process holds it (with its veth pair on the bridge): its processes are found by inode and
  #    stopped when that namespace's lo carries the mark.
  for i in "${!items[@]}"; do
    read -r kind name id extra <<< "${items[i]}"
    [ "$kind" = netns ] || continue
    case "${before[i]}" in
      ours)
        # shellcheck disable=SC2046  # one word per pid
        stop_pids "$name" "$id" $(netns_pids "$id")
        ip netns del "$name" 2>/dev/null || true ;;
      gone)
        # shellcheck disable=SC2046
        mapfile -t pids < <(pids_marked $(netns_pids "$id"))
        stop_pids "$name (deleted by hand, kept alive by its processes)" "$id" ${pids[@]+"${pids[@]}"} ;;
    esac
  done
  # 3. The veth pairs (each namespace's deletion takes its own along, a moment later) and the bridge.
  for i in "${!items[@]}"; do
    read -r kind name id extra <<< "${items[i]}"
    case "$kind" in bridge|veth) ;; *) continue ;; esac
    [ "${before[i]}" = ours ] || continue
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      link_ours "$name" "$id" || break
      ip link del "$name" 2>/dev/null || true
      link_ours "$name" "$id" || break
      sleep 0.2
    done
  done
  # 4. One line for each thing that was not removed here, and the record keeps what is left.
  for i in "${!items[@]}"; do
    line="${items[i]}"
    now="$(item_state "$line")"
    case "${before[i]}/$now" in
      ours/ours)
        echo "hosts.sh: left: $(item_name "$line"): could not be removed" >&2
        left+=("$line") ;;
      ours/*) ;;
      gone/*)
        echo "hosts.sh: already gone: $(item_name "$line") (removed outside scripts/hosts.sh)" >&2 ;;
      other/*)
        echo "hosts.sh: left alone: $(item_name "$line"): the name now holds something scripts/hosts.sh did not make" >&2 ;;
    esac
    [ "${before[i]}/$now" = ours/gone ] || [ "${before[i]}/$now" = ours/other ] || problems=$((problems + 1))
  done
  if [ ${#left[@]} -gt 0 ]; then
    { echo "$STATE_FORMAT"; echo "token $token"; echo "subnet $st_subnet"; echo "dir $st_dir"
      printf '%s\n' "${left[@]}"; } > "$state.new"
    mv "$state.new" "$state"
  else
    rm -f "$state"
    rmdir "$state_dir" 2>/dev/null || true
    rmdir "$STATE_ROOT" 2>/dev/null || true
  fi
  [ "$problems" = 0 ]
}

resolved=""
resolve_host() {  # resolve_host SEL: sets resolved to the namespace of host SEL (index, address or name)
  local sel="$1" ns
  if [[ "$sel" =~ ^[0-9]+$ ]]; then
    ns="$prefix$((10#$sel))"
  elif [[ "$sel" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
    for ns in ${hosts[@]+"${hosts[@]}"}; do
      [ "$(host_addr "$ns")" = "$sel" ] && { resolved="$ns"; return 0; }
    done
    die 1 "no host of prefix $prefix has address $sel (scripts/hosts.sh status)"
  else
    ns="$sel"
  fi
  case " ${hosts[*]-} " in *" $ns "*) ;; *) die 1 "no host '$sel' (namespace $ns) of prefix $prefix (scripts/hosts.sh status)" ;; esac
  resolved="$ns"
}
host_addr() { ip -n "$1" -o -4 addr show dev "$IFACE" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}'; }
host_link() { if ip -n "$1" link show dev "$IFACE" 2>/dev/null | head -1 | grep -q '<[^>]*\bUP\b'; then echo up; else echo down; fi; }
host_qdisc() { ip netns exec "$1" tc qdisc show dev "$IFACE" root 2>/dev/null | head -1 | sed 's/^qdisc //; s/ root refcnt [0-9]*//; s/ *$//'; }
host_shape() {  # prints "rate delay loss" from the alias ('-' for none)
  local a; a="$(ip -n "$1" link show dev "$IFACE" 2>/dev/null | sed -n 's/^ *alias //p' || true)"
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
names_in_use() {  # names_in_use [N]: what has this prefix's names (with N: the names up N makes) and is
                  # not in the record; nothing here is touched
  local n="${1:-}" out
  out="$({ ip netns list 2>/dev/null || true; } | awk -v p="$prefix" -v n="$n" '{k = substr($1, length(p) + 1)}
    index($1, p) == 1 && k ~ /^[0-9]+$/ && (n == "" || k "" == k + 0 "" && k + 0 < n + 0) {printf "namespace %s, ", $1}')"
  out+="$({ ip -o link show 2>/dev/null || true; } | awk -F': ' -v p="$prefix" -v n="$n" '{sub(/@.*/, "", $2); k = substr($2, length(p) + 1)}
    index($2, p) == 1 && (k == "br" || k ~ /^v[0-9]+$/ && (n == "" || substr(k, 2) "" == substr(k, 2) + 0 "" && substr(k, 2) + 0 < n + 0)) {printf "link %s, ", $2}')"
  printf '%s' "${out%, }"
}

# Not silent, whatever fails: the line, the command and its exit status.
# shellcheck disable=SC2154  # rc is set inside the trap
trap 'rc=$?; echo "hosts.sh: $cmd failed at line $LINENO (exit $rc): $BASH_COMMAND" >&2; exit "$rc"' ERR

# ---- commands ----------------------------------------------------------------------------------
case "$cmd" in
up)
  [ ${#positional[@]} -eq 1 ] || die 2 "up takes one argument N (the number of hosts, 1..$MAX_HOSTS)"
  n="${positional[0]}"
  [[ "$n" =~ ^[1-9][0-9]?$ ]] && [ "$n" -le "$MAX_HOSTS" ] || die 2 "N must be an integer 1..$MAX_HOSTS (got '$n')"
  # Can namespaces be made here? Checked without making anything (exit 77 if not).
  command -v ip >/dev/null 2>&1 || skip "no 'ip' (iproute2) on this machine"
  is_root_capable || skip "making network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); running as uid $(id -u) without them"
  ip netns list >/dev/null 2>&1 || skip "'ip netns' does not work here: $(ip netns list 2>&1 | head -1)"
  command -v unshare >/dev/null 2>&1 || skip "no 'unshare' (util-linux) to check namespace support"
  probe_err="$(unshare -n sh -c 'ip link add pa type veth peer name pb && ip link add pbr type bridge && ip link set pa master pbr' 2>&1)" ||
    skip "this kernel/container cannot make veth pairs and bridges in a network namespace: ${probe_err:-unshare -n failed}"
  check_shaping_support

  # The set up made before with this prefix: made anew. What is left of it stops up.
  if ! teardown; then
    state_load && die 1 "the earlier hosts of prefix $prefix could not all be removed (above; $state lists them)"
  fi
  # Names that something else holds are left alone, and stop up before it makes anything.
  in_use="$(names_in_use "$n")"
  [ -z "$in_use" ] || die 1 "not made by scripts/hosts.sh, left alone: $in_use; remove them or choose another --prefix"
  if ip -o -4 route show to "$subnet.0/24" 2>/dev/null | grep -q .; then
    die 1 "subnet $subnet.0/24 is already routed here ($(ip -o -4 route show to "$subnet.0/24" | head -1)): choose another --subnet"
  fi

  # The record first, then each thing, its line added as soon as it exists; on any failure,
  # teardown removes what the record lists.
  token="$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')"
  mark="$TAG:$prefix:$token"
  mkdir -p "$state_dir"
  { echo "$STATE_FORMAT"; echo "# scripts/hosts.sh up's record of what it made; scripts/hosts.sh down --prefix $prefix removes exactly this"
    echo "token $token"; echo "subnet $subnet"; echo "dir $dir"; } > "$state"
  # shellcheck disable=SC2154  # rc is set inside the trap
  trap 'rc=$?; trap - ERR; echo "hosts.sh: up failed (line $LINENO, exit $rc: $BASH_COMMAND); removing what it made" >&2; teardown || true; exit 1' ERR
  ip link add "$bridge" type bridge
  ip link set dev "$bridge" alias "$mark" || { ip link del "$bridge"; false; }
  state_add bridge "$bridge" "$(link_info "$bridge" | awk '{print $1}')"
  ip addr add "$bridge_addr/24" dev "$bridge"
  state_add route "$subnet.0/24" "$bridge"
  ip link set dev "$bridge" up
  for ((k = 0; k < n; k++)); do
    ns="$prefix$k"; veth="${prefix}v$k"
    ip netns add "$ns"
    ip -n "$ns" link set dev lo alias "$mark" || { ip netns del "$ns"; false; }
    state_add netns "$ns" "$(netns_inode "$ns")"
    ip -n "$ns" link set dev lo up
    ip link add "$veth" type veth peer name "$IFACE" netns "$ns"  # deleting $ns takes it along
    ip link set dev "$veth" alias "$mark"
    ip -n "$ns" link set dev "$IFACE" alias "$mark"
    state_add veth "$veth" "$(link_info "$veth" | awk '{print $1}')" "$ns"
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
  dirs=()
  [ "$dir_given" = 1 ] && dirs+=("$dir")
  if [ -f "$state" ]; then
    need_root
    down_ok=1
    teardown || down_ok=0
    [ "$dir_given" = 1 ] || [ -z "$st_dir" ] || dirs+=("$st_dir")
  else
    down_ok=1
    [ "$dir_given" = 1 ] || dirs+=("$dir")
  fi
  in_use="$(if command -v ip >/dev/null 2>&1; then names_in_use; fi)"
  [ -z "$in_use" ] || echo "hosts.sh: not in $state, so not made by scripts/hosts.sh and left alone: $in_use" >&2
  for d in ${dirs[@]+"${dirs[@]}"}; do  # the files up wrote there, where they are this prefix's
    if [ -f "$d/hosts.env" ] && grep -qx "DISTCA_HOSTS_PREFIX=$(shq "$prefix")" "$d/hosts.env"; then
      rm -f "$d/hostfile" "$d/hosts.env" "$d/hosts.json"
      rmdir "$d" 2>/dev/null || true
    fi
  done
  [ "$down_ok" = 1 ] ||
    die 1 "down: the hosts of prefix $prefix were not whole: removed the rest; $problems recorded thing(s) already gone or left (one line each above)"
  ;;

shape)
  [ ${#positional[@]} -eq 0 ] || die 2 "shape takes no arguments (--host K for one host)"
  if [ "$clear" = 1 ]; then
    [ -z "$rate$delay$loss" ] || die 2 "shape: --clear with --rate/--delay/--loss"
  else
    [ -n "$rate$delay$loss" ] || die 2 "shape: give --rate, --delay and/or --loss, or --clear"
  fi
  need_root
  hosts_load
  [ ${#hosts[@]} -gt 0 ] || die 1 "no hosts of prefix $prefix (scripts/hosts.sh up N)"
  check_shaping_support
  if [ -n "$host_sel" ]; then resolve_host "$host_sel"; targets=("$resolved"); else targets=("${hosts[@]}"); fi
  for ns in "${targets[@]}"; do apply_shape "$ns"; done
  ;;

link-down|link-up)
  [ ${#positional[@]} -eq 1 ] || die 2 "$cmd takes one argument K (host index, address or namespace)"
  need_root
  hosts_load
  resolve_host "${positional[0]}"
  ns="$resolved"
  ip -n "$ns" link set dev "$IFACE" "${cmd#link-}"
  echo "hosts.sh: $ns ($(host_addr "$ns")) $IFACE ${cmd#link-}"
  ;;

status)
  [ ${#positional[@]} -eq 0 ] || die 2 "status takes no arguments"
  command -v ip >/dev/null 2>&1 || die 1 "no 'ip' (iproute2)"
  hosts_load
  nss=(${hosts[@]+"${hosts[@]}"})
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
