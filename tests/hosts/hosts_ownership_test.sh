#!/usr/bin/env bash
# scripts/hosts.py touches only what it made, says what it could not remove, and checks its
# arguments before it makes anything; scripts/bench-link.sh checks its flags before it makes hosts.
#   tests/hosts/hosts_ownership_test.sh        (CTest: Hosts.OwnershipAndValidation, about 15 s)
# Checks, one PASS/FAIL line each saying what it checks; exit 1 if any fails, 77 (skip) without
# root or `ip netns`:
#   foreign.*   namespaces and links with the prefix's names that hosts.py did not make (empty
#               aliases), and a process in such a namespace, survive down (with and without a
#               set of its own beside them); up refuses a name held by one, making nothing
#   partial.*   a down after a host's eth0 or a whole namespace was deleted by hand (also one
#               kept alive by a process in it) removes the rest, exits non-zero and names what
#               was not there
#   subnet.*    bad --subnet values (010.77.0: octal to iproute2, 8.8.8: public, 1.2.3.4.5,
#   args.*      256.1.1, empty, letters) and other bad arguments: exit 2, one line, nothing made
#   record.*    a record that scripts/hosts.sh (the shell script hosts.py replaced) wrote is
#               read and removed by down; a state file that is no record is refused (exit 1), untouched
#   benchlink.* bench-link.sh's bad flags: exit 2, one line, no host made
# Prefixes dho, dhp, dhq, -dhq (not distca-h, the multihost test's dct, nor bench-link's dbl), subnets
# 10.74.1-3. Everything the test makes is removed on exit, even when a check fails.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
hosts_py="$root/scripts/hosts.py"
# The system's python3 runs hosts.py here, as it does for root on a fresh machine: a version
# manager's shim first in PATH (pyenv's takes 0.1-0.3 s a start) would add seconds to the ~30
# runs below. (tests/hosts/multihost_test.sh runs the script itself, by its #! line.)
python3_bin=/usr/bin/python3
[ -x "$python3_bin" ] || python3_bin="$(command -v python3 || echo python3)"
hs() { "$python3_bin" "$hosts_py" "$@"; }
bench_link="$root/scripts/bench-link.sh"
run_dir="/run/distca-hosts"   # hosts.py's records
prefixes=(dho dhp dhq -dhq)    # this test's own: whatever has their names is removed at the end

if [ "$(id -u)" != 0 ]; then echo "SKIP: needs root to make network namespaces (uid $(id -u))"; exit 77; fi
for tool in ip unshare nsenter; do
  command -v "$tool" >/dev/null 2>&1 || { echo "SKIP: no '$tool'"; exit 77; }
done
if ! err="$(ip netns add dho-probe 2>&1)"; then echo "SKIP: 'ip netns add' does not work here: $err"; exit 77; fi
ip netns del dho-probe

work="$(mktemp -d "${TMPDIR:-/tmp}/distca-hosts-ownership.XXXXXX")"
bg=()       # the processes this test started (sleep in a namespace), stopped by pid at the end
mon_pid=""  # ip monitor link
failed=()

names_of() {  # names_of PREFIX: what has the prefix's names: namespaces, links, the record, the route
  local p="$1"
  { ip netns list 2>/dev/null || true; } | awk -v p="$p" 'index($1, p) == 1 && substr($1, length(p) + 1) ~ /^[0-9]+$/ {print "namespace " $1}'
  { ip -o link show 2>/dev/null || true; } | awk -F': ' -v p="$p" '{sub(/@.*/, "", $2); k = substr($2, length(p) + 1)}
    index($2, p) == 1 && (k == "br" || k ~ /^v[0-9]+$/) {print "link " $2}'
  [ ! -e "$run_dir/$p" ] || echo "record $run_dir/$p"
  return 0
}
force_clean() {  # removes, by name, whatever has this test's prefixes (they are the test's own)
  local p n
  for p in "${prefixes[@]}"; do
    # down where a record is left (most checks leave none: a down for each would cost a Python start)
    [ ! -e "$run_dir/$p/state" ] || hs down --prefix "$p" --dir "$work/$p" >/dev/null 2>&1 || true
    rm -rf "${work:?}/$p"
    for n in $(names_of "$p" | awk '$1 == "namespace" {print $2}'); do ip netns del "$n" 2>/dev/null || true; done
    for n in $(names_of "$p" | awk '$1 == "link" {print $2}'); do ip link del "$n" 2>/dev/null || true; done
    rm -rf "${run_dir:?}/$p"
  done
  rmdir "$run_dir" 2>/dev/null || true
}
cleanup() {
  local rc=$? p
  trap - EXIT INT TERM
  for p in ${bg[@]+"${bg[@]}"}; do kill -KILL "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  [ -z "$mon_pid" ] || { kill "$mon_pid" 2>/dev/null || true; wait "$mon_pid" 2>/dev/null || true; }
  force_clean
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'echo "interrupted"; exit 130' INT TERM

check() {  # check NAME WHAT PROBLEM: PASS where PROBLEM is empty
  if [ -z "$3" ]; then echo "PASS $1: $2"; else echo "FAIL $1: $2: $3"; failed+=("$1"); fi
}
sleep_in() {  # sleep_in NS: a sleep in namespace NS, its pid in $last_bg
  ip netns exec "$1" sleep 300 &
  last_bg=$!
  bg+=("$last_bg")
  for _ in $(seq 50); do [ "$(ip netns identify "$last_bg" 2>/dev/null)" = "$1" ] && return 0; sleep 0.02; done
}
alive() { kill -0 "$1" 2>/dev/null && [ "$(cat "/proc/$1/comm" 2>/dev/null)" = sleep ]; }
up_problem=""
up_or_skip() {  # up_or_skip ARGS...: hosts.py up (a failure in up_problem); exits 77 where hosts cannot be made here
  local out rc=0
  out="$(hs up "$@" 2>&1)" || rc=$?
  if [ "$rc" = 77 ]; then echo "SKIP: cannot make test hosts here: $out"; exit 77; fi
  up_problem=""
  [ "$rc" = 0 ] || up_problem="hosts.py up $* exited $rc: $out; "
}
force_clean

# ---- foreign: what hosts.py did not make ------------------------------------------------------
# 1. Nothing recorded: a namespace dho0 with a process in it and links dhobr, dhov0 (bridges with
#    no alias) that the test made stay, with the process.
ip netns add dho0; sleep_in dho0; s0="$last_bg"
ip link add dhobr type bridge; ip link add dhov0 type bridge
rc=0; out="$(hs down --prefix dho --dir "$work/dho" 2>&1)" || rc=$?
problem=""
[ "$rc" = 0 ] || problem+="down exited $rc ($out); "
alive "$s0" || problem+="the sleep in dho0 (pid $s0) was killed; "
[ -e /var/run/netns/dho0 ] || problem+="dho0 was deleted; "
for l in dhobr dhov0; do ip link show dev "$l" >/dev/null 2>&1 || problem+="link $l was deleted; "; done
check foreign.no-record "down --prefix dho with no record leaves the test's own namespace dho0 (and its sleep) and links dhobr, dhov0 (no alias) alone" "$problem"

# 2. up refuses a name that something else holds, and makes nothing.
rc=0; out="$(hs up 2 --prefix dho --subnet 10.74.1 --dir "$work/dho" 2>&1)" || rc=$?
problem=""
[ "$rc" = 1 ] || problem+="up exited $rc, not 1; "
[ "$(printf '%s\n' "$out" | grep -c .)" = 1 ] && [[ "$out" == *dho0* ]] || problem+="not one line naming dho0: '$out'; "
alive "$s0" || problem+="the sleep in dho0 was killed; "
[ -e /var/run/netns/dho0 ] || problem+="dho0 was deleted; "
[ -z "$(names_of dho | grep -v -x -e 'namespace dho0' -e 'link dhobr' -e 'link dhov0')" ] ||
  problem+="up made: $(names_of dho | grep -v -x -e 'namespace dho0' -e 'link dhobr' -e 'link dhov0' | tr '\n' ' '); "
[ ! -e "$work/dho" ] || problem+="up wrote $work/dho; "
check foreign.up-refuses "up 2 --prefix dho beside a foreign dho0 and dhobr exits 1 with one line, makes nothing, leaves them" "$problem"
ip link del dhobr

# 3. A set of hosts.py's own beside foreign dho7 (with a process) and dhov7: down removes the set only.
kill -KILL "$s0"; wait "$s0" 2>/dev/null; ip netns del dho0; ip link del dhov0
ip netns add dho7; sleep_in dho7; s7="$last_bg"
ip link add dhov7 type bridge
up_or_skip 2 --prefix dho --subnet 10.74.1 --dir "$work/dho"; problem="$up_problem"
rc=0; out="$(hs down --prefix dho 2>&1)" || rc=$?
[ "$rc" = 0 ] || problem+="down exited $rc ($out); "
alive "$s7" || problem+="the sleep in dho7 (pid $s7) was killed; "
[ -e /var/run/netns/dho7 ] || problem+="dho7 was deleted; "
ip link show dev dhov7 >/dev/null 2>&1 || problem+="link dhov7 was deleted; "
left="$(names_of dho | grep -v -x -e 'namespace dho7' -e 'link dhov7' | tr '\n' ' ')"
[ -z "$left" ] || problem+="down left its own: $left; "
[ ! -e "$work/dho/hosts.env" ] || problem+="down left $work/dho/hosts.env; "
check foreign.beside-own "up 2 then down --prefix dho removes dho0, dho1, dhobr, dhov0-1, the record and the files, and leaves foreign dho7 (and its sleep) and dhov7" "$problem"
kill -KILL "$s7"; wait "$s7" 2>/dev/null; ip netns del dho7; ip link del dhov7

# ---- partial: a set damaged by hand -------------------------------------------------------------
nothing_left() {  # nothing_left PREFIX SUBNET: prints what is left of the set
  names_of "$1" | tr '\n' ' '
  ip -o -4 route show to "$2.0/24" 2>/dev/null | sed 's/^/route /' | tr '\n' ' '
  [ ! -e "$work/$1/hosts.env" ] || printf 'file %s ' "$work/$1/hosts.env"
}
partial() {  # partial NAME WHAT NEEDLES... -- DAMAGE...: up 3, damage, down: non-zero, lines name the needles, nothing left
  local name="$1" what="$2" needles=() problem rc=0 out n
  shift 2
  while [ "$1" != -- ]; do needles+=("$1"); shift; done
  shift
  up_or_skip 3 --prefix dhp --subnet 10.74.2 --dir "$work/dhp"; problem="$up_problem"
  "$@"
  out="$(hs down --prefix dhp 2>&1)" || rc=$?
  [ "$rc" != 0 ] || problem+="down exited 0; "
  for n in "${needles[@]}"; do printf '%s\n' "$out" | grep -q -- "$n" || problem+="no line names '$n'; "; done
  [ -n "$out" ] || problem+="down printed nothing; "
  [ -z "$(nothing_left dhp 10.74.2)" ] || problem+="left: $(nothing_left dhp 10.74.2); "
  [ -z "$problem" ] || problem+="its output: $(printf '%s' "$out" | tr '\n' '|')"
  check "$name" "$what" "$problem"
  force_clean
}
partial partial.eth0-deleted "after 'ip netns exec dhp1 ip link del eth0', down removes the rest and exits non-zero naming dhp1's eth0" \
  dhp1 eth0 -- ip netns exec dhp1 ip link del eth0
partial partial.netns-deleted "after 'ip netns del dhp0', down removes the rest and exits non-zero naming dhp0" \
  'namespace dhp0' -- ip netns del dhp0
kept_alive() { sleep_in dhp0; s_kept="$last_bg"; ip netns del dhp0; }
partial partial.netns-deleted-kept-alive "after 'ip netns del dhp0' with a sleep still in it, down stops the sleep, removes the rest (dhpv0 too) and names dhp0" \
  'namespace dhp0' -- kept_alive
problem=""
for _ in $(seq 20); do alive "$s_kept" || break; sleep 0.1; done
alive "$s_kept" && problem="the sleep in the deleted dhp0 (pid $s_kept) still runs"
wait "$s_kept" 2>/dev/null
check partial.kept-alive-stopped "the process in the namespace up made and a hand deleted is stopped by down" "$problem"

# ---- arguments: checked before anything is made -------------------------------------------------
ip -o monitor link > "$work/monitor" 2>&1 &
mon_pid=$!
sleep 0.2
made_links() {  # made_links PREFIX FROM: links with the prefix's names created since line FROM of the monitor
  sleep 0.1
  tail -n +"$(($2 + 1))" "$work/monitor" | awk -F': ' -v p="$1" '$1 !~ /^Deleted/ {sub(/@.*/, "", $2); k = substr($2, length(p) + 1)}
    $1 !~ /^Deleted/ && index($2, p) == 1 && (k == "br" || k ~ /^v[0-9]+$/) && !seen[$2]++ {printf "%s ", $2}'
}
bad_args() {  # bad_args NAME PREFIX COMMAND...: exit 2, one line, nothing made
  local name="$1" p="$2" from rc=0 out problem=""
  shift 2
  from="$(wc -l < "$work/monitor")"
  out="$("$@" 2>&1)" || rc=$?
  [ "$rc" = 2 ] || problem+="exit $rc, not 2; "
  [ "$(printf '%s\n' "$out" | grep -c .)" = 1 ] || problem+="$(printf '%s\n' "$out" | grep -c .) lines, not 1; "
  [ -z "$(made_links "$p" "$from")" ] || problem+="made links $(made_links "$p" "$from"); "
  [ -z "$(names_of "$p")" ] || problem+="left $(names_of "$p" | tr '\n' ' '); "
  [ ! -e "$work/$p" ] || problem+="wrote $work/$p; "
  [ -z "$problem" ] || problem+="output: $(printf '%s' "$out" | tr '\n' '|' | cut -c1-300)"
  check "$name" "$(printf '%q ' "${@:2}" | sed "s|$root/||g")-> exit 2, one line, nothing made" "$problem"
  force_clean
}
for s in 010.77.0 8.8.8 1.2.3.4.5 256.1.1 "" abc; do
  bad_args "subnet.${s:-empty}" dhq hs up 1 --prefix dhq --dir "$work/dhq" --subnet "$s"
done
bad_args args.count-0 dhq hs up 0 --prefix dhq --dir "$work/dhq" --subnet 10.74.3
bad_args args.count-33 dhq hs up 33 --prefix dhq --dir "$work/dhq" --subnet 10.74.3
bad_args args.slots-0 dhq hs up 1 --prefix dhq --dir "$work/dhq" --subnet 10.74.3 --slots 0
bad_args args.prefix-dash -dhq hs up 1 --prefix -dhq --dir "$work/-dhq" --subnet 10.74.3
bad_args args.dir-not-folder dhq hs up 1 --prefix dhq --dir /dev/null/dhq --subnet 10.74.3
bad_args args.rate-0 dhq hs up 1 --prefix dhq --dir "$work/dhq" --subnet 10.74.3 --rate 0mbit
bad_args args.loss-over-100 dhq hs up 1 --prefix dhq --dir "$work/dhq" --subnet 10.74.3 --loss 101%
bad_args args.delay-no-unit dhq hs up 1 --prefix dhq --dir "$work/dhq" --subnet 10.74.3 --delay 5
bad_args args.unknown-option dhq hs up 1 --prefix dhq --dir "$work/dhq" --sublet 10.74.3
bad_args args.option-not-taken dhq hs down --prefix dhq --dir "$work/dhq" --subnet 10.74.3
bad_args args.shape-clear-and-rate dhq hs shape --prefix dhq --clear --rate 1mbit

# ---- record: the state file --------------------------------------------------------------------
# 1. A record as scripts/hosts.sh, this program's shell predecessor, wrote it (format 1, no comment
#    line), of a namespace and a bridge carrying its mark: down removes both, and the record.
token=0123456789ab
ip netns add dhq0; ip -n dhq0 link set dev lo alias "distca-hosts:dhq:$token"
ip link add dhqbr type bridge; ip link set dev dhqbr alias "distca-hosts:dhq:$token"
mkdir -p "$run_dir/dhq"
printf 'distca-hosts-state 1\ntoken %s\nsubnet 10.74.3\ndir %s\nbridge dhqbr %s\nnetns dhq0 %s\n' "$token" "$work/dhq" \
  "$(ip -o link show dev dhqbr | cut -d: -f1)" "$(stat -L -c %i /var/run/netns/dhq0)" > "$run_dir/dhq/state"
rc=0; out="$(hs down --prefix dhq 2>&1)" || rc=$?
problem=""
[ "$rc" = 0 ] || problem+="down exited $rc ($out); "
[ -z "$(names_of dhq)" ] || problem+="left: $(names_of dhq | tr '\n' ' '); "
check record.format-1 "down --prefix dhq removes the namespace and bridge of a format-1 record that scripts/hosts.sh wrote, and the record" "$problem"
force_clean

# 2. A state file that is no record: down exits 1 with one line naming it, and touches nothing.
ip netns add dhq0; mkdir -p "$run_dir/dhq"; echo "not a record" > "$run_dir/dhq/state"
rc=0; out="$(hs down --prefix dhq 2>&1)" || rc=$?
problem=""
[ "$rc" = 1 ] || problem+="down exited $rc, not 1; "
[ "$(printf '%s\n' "$out" | grep -c .)" = 1 ] && [[ "$out" == *"$run_dir/dhq/state"* ]] || problem+="not one line naming the file: '$out'; "
[ -e /var/run/netns/dhq0 ] || problem+="dhq0 was deleted; "
[ -f "$run_dir/dhq/state" ] || problem+="the file was removed; "
check record.not-a-record "down --prefix dhq over a state file that is no record exits 1 with one line naming it, leaves it and dhq0" "$problem"
force_clean

if [ -n "$(names_of dbl)" ]; then
  echo "SKIP benchlink.*: hosts of prefix dbl exist (a bench-link.sh run?): $(names_of dbl | tr '\n' ' ')"
else
  # Flags an older bench-link.sh took and found bad only after making its hosts (rates that
  # hosts.py shape refuses, an unknown preset, a --json it cannot write at the end).
  bad_args benchlink.rates-0 dbl "$bench_link" --rates 0
  bad_args benchlink.rates-too-high dbl "$bench_link" --rates 100000
  bad_args benchlink.rates-one-bad dbl "$bench_link" --rates 1,0
  bad_args benchlink.rates-empty-item dbl "$bench_link" --rates 1,,0.3
  bad_args benchlink.preset dbl "$bench_link" --rates 1 --rounds 1 --steps 1 --preset nosuch
  bad_args benchlink.json-unwritable dbl "$bench_link" --rates 1 --rounds 1 --steps 1 --preset tiny --json /nonexistent/dir/out.json
  bad_args benchlink.rounds-0 dbl "$bench_link" --rounds 0
  bad_args benchlink.layers-too-many dbl "$bench_link" --layers 65
  bad_args benchlink.layers-word dbl "$bench_link" --layers two
  bad_args benchlink.rates-no-value dbl "$bench_link" --rates
  bad_args benchlink.grad-sync dbl "$bench_link" --grad-sync sometimes
  bad_args benchlink.interval-too-short dbl "$bench_link" --progress thread --progress-interval-us 5
  bad_args benchlink.rate-mbit-0 dbl "$bench_link" --rate-mbit 0
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all hosts.py ownership and argument checks passed"
