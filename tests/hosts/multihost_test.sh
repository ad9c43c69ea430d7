#!/usr/bin/env bash
# distca train over test hosts (scripts/hosts.py: network namespaces on a bridge, Open MPI's rsh
# launcher through scripts/netns-agent.sh, TCP only). Usage (CTest passes both):
#   tests/hosts/multihost_test.sh DISTCA [MPIRUN]
# Cases, each one PASS/FAIL line with its numbers and wall time; exit 1 if any fails, 77 (skip)
# where the hosts cannot be made here (no root, no namespaces):
#   a  2 ranks over 2 hosts give bit for bit the losses of 2 local ranks (cad, --compare), and 4
#      ranks over 2 hosts those of 4 local ranks (--tp 2, --pp 2), and 4 ranks over 4 hosts (cad)
#   b  the same 2-host run with 5 % packet loss on every host's link (TCP retransmits)
#   e  a 2-host run with --checkpoint and --save-every 3 whose host-1 rank is killed after step
#      3's checkpoint; resumed on the 2 hosts, steps 4-6 equal the uninterrupted local run's
#   d  a host's rank killed: the job ends within 30 s, non-zero, nothing left on the hosts
#   c  a host's link dropped mid-run: the job ends within 30 s, non-zero, with a line naming the
#      lost host, nothing left; with the default --timeout, and in the soak run
#      (DISTCA_TEST_LONG=1) also with --timeout 3
# Hosts: prefix dct, subnet 10.78.0 (not the default distca-h / 10.77.0, so a user's hosts are
# left alone), files in a temporary folder under the build tree; always removed on exit.
set -Eeuo pipefail

[ $# -ge 1 ] || { echo "usage: $0 DISTCA [MPIRUN]" >&2; exit 2; }
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
hosts_py="$root/scripts/hosts.py"
distca="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
mpirun="${2:-mpirun}"
[ -x "$distca" ] || { echo "FAIL: no distca binary at $1" >&2; exit 1; }
command -v "$mpirun" >/dev/null 2>&1 || { echo "SKIP: no mpirun ($mpirun) to run ranks with"; exit 77; }
command -v python3 >/dev/null 2>&1 || { echo "SKIP: no python3 to compare the losses with"; exit 77; }

prefix=dct
subnet=10.78.0
# The build tree (distca is BUILD/src/tools/distca), else the working directory.
build="$(cd "$(dirname "$distca")/../.." && pwd)"
[ -f "$build/CMakeCache.txt" ] || build="$(pwd)"
work="$(mktemp -d "$build/dct-multihost.XXXXXX")"
hosts_dir="$work/hosts"
hs() { "$hosts_py" "$@" --prefix "$prefix"; }
# hosts.py down removes what its up recorded (/run/distca-hosts/PREFIX/state), including a veth
# pair that a deleted namespace takes along a moment later; it names on stderr anything it could
# not remove and exits non-zero then.
hosts_down() { "$hosts_py" down --prefix "$prefix" --dir "$hosts_dir" >/dev/null; }

bg_pids=()  # mpirun processes this test started in the background
bg_pid=""   # the latest of them
bg_rc=0
noted=""    # the processes on the hosts while a fault case's job ran
failed=()
keep_work="${DISTCA_TEST_KEEP:-0}"  # 1: keep the logs (they are kept anyway when a case fails)
cleanup() {
  local rc=$? p
  trap - EXIT INT TERM
  for p in ${bg_pids[@]+"${bg_pids[@]}"}; do
    if kill -0 "$p" 2>/dev/null; then kill -TERM "$p" 2>/dev/null || true; sleep 1; kill -KILL "$p" 2>/dev/null || true; fi
  done
  hosts_down || true
  if [ "$keep_work" = 1 ]; then echo "logs kept in $work"; else rm -rf "$work"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'echo "error: line $LINENO: $BASH_COMMAND exited $?" >&2' ERR
trap 'echo "interrupted"; keep_work=1; exit 130' INT TERM

# ---- the hosts ---------------------------------------------------------------------------------
up_rc=0
up_out="$("$hosts_py" up 4 --prefix "$prefix" --subnet "$subnet" --dir "$hosts_dir" 2>&1)" || up_rc=$?
if [ "$up_rc" = 77 ]; then
  echo "SKIP: cannot make test hosts here: $(printf '%s\n' "$up_out" | grep -m1 'skipped' || printf '%s' "$up_out" | head -1)"
  exit 77
fi
[ "$up_rc" = 0 ] || { echo "FAIL: hosts.py up 4 exited $up_rc: $up_out"; exit 1; }
# shellcheck disable=SC1091
source "$hosts_dir/hosts.env"
export DISTCA_HOSTS_PREFIX  # netns-agent.sh maps addresses to this prefix's namespaces only
read -r -a host_flags <<< "$DISTCA_MPIRUN_HOST_FLAGS"
head -2 "$DISTCA_HOSTS_HOSTFILE" > "$work/hostfile2"
cp "$DISTCA_HOSTS_HOSTFILE" "$work/hostfile4"
base=("$mpirun" --allow-run-as-root --oversubscribe --bind-to none)

# Every rank on the hosts starts through this: it notes its host (namespace), then becomes distca
# (same process: exec).
cat > "$work/rank.sh" <<'EOF'
#!/bin/sh
d="$1"; shift
ns="$(ip netns identify $$ 2>/dev/null)" || ns=""
[ -n "$ns" ] || ns="$(hostname)"
echo "$ns" > "$d/rank.${OMPI_COMM_WORLD_RANK:-x}"
exec "$@"
EOF
chmod +x "$work/rank.sh"

# cmp.py A B [FIRST_STEP]: per-step losses of two --json files, by (step, backend), bit for bit.
cat > "$work/cmp.py" <<'EOF'
import json, sys
def losses(path, first):
    with open(path) as f:
        j = json.load(f)
    if (j.get("format"), j.get("version")) != ("distca-train", 3):
        print(f"{path} is {j.get('format')} version {j.get('version')}, this script reads distca-train version 3: "
              "rerun distca train")
        sys.exit(1)
    return {(s["step"], s["backend"]): s["loss"] for s in j["steps"] if s["step"] >= first}
a_path, b_path = sys.argv[1], sys.argv[2]
first = int(sys.argv[3]) if len(sys.argv) > 3 else 1
a, b = losses(a_path, first), losses(b_path, first)
if not a or sorted(a) != sorted(b):
    print(f"records differ: {sorted(a)} vs {sorted(b)}")
    sys.exit(1)
diff = max(abs(a[k] - b[k]) for k in a)
same = all(float(a[k]).hex() == float(b[k]).hex() for k in a)
steps = sorted({k[0] for k in a})
backends = sorted({k[1] for k in a})
print(f"{len(a)} losses (steps {steps[0]}-{steps[-1]}, {'+'.join(backends)}), largest difference {diff:.3g}, "
      f"bit for bit: {'yes' if same else 'no'}")
sys.exit(0 if same else 1)
EOF

now() { echo "$EPOCHREALTIME"; }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN {printf "%.1f", b - a}'; }
result() {  # result NAME START OK DETAILS
  if [ "$3" = 0 ]; then echo "PASS $1 ($(since "$2") s): $4"; else echo "FAIL $1 ($(since "$2") s): $4"; failed+=("$1"); keep_work=1; fi
}

local_run() {  # local_run NP OUT ARGS...: plain local mpirun (one "host": this namespace)
  local np="$1" out="$2"; shift 2
  timeout -k 5 90 "${base[@]}" -np "$np" "$distca" train "$@" < /dev/null > "$out.log" 2>&1
}
hosts_run() {  # hosts_run HOSTFILE NP OUT ARGS...: over the hosts, ranks round robin (--map-by node)
  local hf="$1" np="$2" out="$3"; shift 3
  mkdir -p "$out.place"
  timeout -k 5 90 "${base[@]}" "${host_flags[@]}" --hostfile "$hf" --map-by node -np "$np" \
    "$work/rank.sh" "$out.place" "$distca" train "$@" < /dev/null > "$out.log" 2>&1
}
placement_ok() {  # placement_ok OUT NP NHOSTS: rank r ran on host r % NHOSTS
  local r want got
  for ((r = 0; r < $2; r++)); do
    want="$prefix$((r % $3))"
    got="$(cat "$1.place/rank.$r" 2>/dev/null || echo none)"
    [ "$got" = "$want" ] || { echo "rank $r ran on $got, not $want"; return 1; }
  done
}
tail_of() { tail -n "${2:-5}" "$1" | sed 's/^/    | /'; }

# a: same losses, 1 host and N hosts ------------------------------------------------------------
same_losses() {  # same_losses NAME NP NHOSTS ARGS...
  local name="$1" np="$2" nh="$3"; shift 3
  local t0 out="$work/$name" msg hf="$work/hostfile2"
  t0="$(now)"
  [ "$nh" = 4 ] && hf="$work/hostfile4"
  if ! local_run "$np" "$out.local" --preset tiny --steps 6 --json "$out.local.json" "$@"; then
    result "$name" "$t0" 1 "the local run failed"; tail_of "$out.local.log"; return
  fi
  if ! hosts_run "$hf" "$np" "$out.hosts" --preset tiny --steps 6 --json "$out.hosts.json" "$@"; then
    result "$name" "$t0" 1 "the run over $nh hosts failed"; tail_of "$out.hosts.log"; return
  fi
  if ! msg="$(placement_ok "$out.hosts" "$np" "$nh")"; then result "$name" "$t0" 1 "$msg"; return; fi
  local ok=0
  msg="$(python3 "$work/cmp.py" "$out.local.json" "$out.hosts.json")" || ok=1
  result "$name" "$t0" "$ok" "$np ranks, 1 host vs $nh hosts ($*): $msg"
}

same_losses a.cad-2x2 2 2 --attention cad
same_losses a.compare-2x2 2 2 --compare
same_losses a.tp2-4x2 4 2 --tp 2
same_losses a.pp2-4x2 4 2 --pp 2
same_losses a.cad-4x4 4 4 --attention cad

# b: 5 % loss ---------------------------------------------------------------------------------------
shaper_drops() {  # packets the shaping dropped so far on hosts 0 and 1 (netem's, or htb's drop class)
  local ns sum=0 v
  for ns in "${prefix}0" "${prefix}1"; do
    v="$(ip netns exec "$ns" tc -s qdisc show dev eth0 2>/dev/null | awk '/^qdisc/ {q = $2} /dropped/ && q != "htb" {gsub(/,/, "", $7); s += $7} END {print s + 0}')"
    sum=$((sum + ${v:-0}))
  done
  echo "$sum"
}
retrans() {  # TCP segments retransmitted so far on hosts 0 and 1 (their own counters)
  local ns sum=0 v
  for ns in "${prefix}0" "${prefix}1"; do
    # shellcheck disable=SC2016  # awk's own $
    v="$(ip netns exec "$ns" awk '/^Tcp:/ {if (!h) {for (i = 1; i <= NF; i++) if ($i == "RetransSegs") c = i; h = 1} else print $c}' /proc/net/snmp)"
    sum=$((sum + ${v:-0}))
  done
  echo "$sum"
}
case_b() {
  local t0 out="$work/b" r0 r1 drops msg ok=0
  t0="$(now)"
  if ! hs shape --loss 5% >/dev/null; then result b.loss5 "$t0" 1 "hosts.py shape --loss 5% failed"; return; fi
  r0="$(retrans)"
  if ! hosts_run "$work/hostfile2" 2 "$out" --preset tiny --steps 6 --json "$out.json" --attention cad; then
    hs shape --clear >/dev/null || true
    result b.loss5 "$t0" 1 "the run over 2 hosts with 5 % loss failed"; tail_of "$out.log"; return
  fi
  r1="$(retrans)"
  drops="$(shaper_drops)"
  hs shape --clear >/dev/null
  msg="$(python3 "$work/cmp.py" "$work/a.cad-2x2.local.json" "$out.json")" || ok=1
  result b.loss5 "$t0" "$ok" "2 ranks, 1 host vs 2 hosts at 5 % loss (packets dropped: $drops, TCP segments retransmitted: $((r1 - r0))): $msg"
}
case_b

# The faults: a background run over 2 hosts ------------------------------------------------------
start_bg() {  # start_bg OUT ARGS...: sets bg_pid
  local out="$1"; shift
  mkdir -p "$out.place"
  "${base[@]}" "${host_flags[@]}" --hostfile "$work/hostfile2" --map-by node -np 2 \
    "$work/rank.sh" "$out.place" "$distca" train "$@" < /dev/null > "$out.log" 2>&1 &
  bg_pid=$!
  bg_pids+=("$bg_pid")
}
wait_for_line() {  # wait_for_line FILE REGEX SECONDS
  local end; end=$(awk -v t="$EPOCHREALTIME" -v s="$3" 'BEGIN {printf "%.3f", t + s}')
  while ! grep -qE "$2" "$1" 2>/dev/null; do
    awk -v t="$EPOCHREALTIME" -v e="$end" 'BEGIN {exit !(t > e)}' && return 1
    kill -0 "$bg_pid" 2>/dev/null || { grep -qE "$2" "$1" 2>/dev/null; return; }
    sleep 0.02
  done
}
ns_pids() { ip netns pids "$prefix$1" 2>/dev/null | tr '\n' ' ' | sed 's/ *$//'; }
distca_pids() {  # distca_pids K: the distca processes in host K
  local p
  for p in $(ip netns pids "$prefix$1" 2>/dev/null); do
    [ "$(readlink "/proc/$p/exe" 2>/dev/null)" = "$distca" ] && echo "$p"
  done
  return 0
}
wait_end() {  # wait_end SECONDS: waits for bg_pid at most that long; sets bg_rc (-1: still running)
  local end; end=$(awk -v t="$EPOCHREALTIME" -v s="$1" 'BEGIN {printf "%.3f", t + s}')
  while kill -0 "$bg_pid" 2>/dev/null; do
    awk -v t="$EPOCHREALTIME" -v e="$end" 'BEGIN {exit !(t > e)}' && { bg_rc=-1; return; }
    sleep 0.05
  done
  bg_rc=0; wait "$bg_pid" || bg_rc=$?
}
left_behind() {  # what still runs: in hosts 0 and 1, and of the processes noted at the start
  local out="" k p pids
  for k in 0 1; do
    pids="$(ns_pids "$k")"
    [ -z "$pids" ] || out+="$prefix$k: $(ps -o pid=,comm= -p "${pids// /,}" 2>/dev/null | awk '{printf "%s%s(%s)", s, $2, $1; s = " "}'); "
  done
  for p in $noted; do
    kill -0 "$p" 2>/dev/null && out+="noted pid $p ($(cat "/proc/$p/comm" 2>/dev/null)) alive; "
  done
  kill -0 "$bg_pid" 2>/dev/null && out+="mpirun $bg_pid alive; "
  printf '%s' "$out"
}
wait_clean() {  # wait_clean SECONDS: until nothing is left behind (what remains is printed)
  local i left
  for ((i = 0; i < $1 * 10; i++)); do
    left="$(left_behind)"
    [ -z "$left" ] && return 0
    sleep 0.1
  done
  printf '%s' "$left"
  return 1
}
stop_bg() {  # the job did not end: end it (this test's mpirun, by its pid) and what it left
  kill -TERM "$bg_pid" 2>/dev/null || true
  sleep 2
  kill -KILL "$bg_pid" 2>/dev/null || true
  local k
  # shellcheck disable=SC2046  # one word per pid
  for k in 0 1; do kill -KILL $(ns_pids "$k") 2>/dev/null || true; done
  wait "$bg_pid" 2>/dev/null || true
}
fault_verdict() {  # fault_verdict NAME T0 T_FAULT WHAT [NAMES_PEER_REGEX]
  local name="$1" t0="$2" tf="$3" what="$4" names="${5:-}" out="$work/$1" took left first
  wait_end 30
  took="$(since "$tf")"
  if [ "$bg_rc" = -1 ]; then
    left="$(left_behind)"
    stop_bg
    result "$name" "$t0" 1 "$what: the job still ran 30 s later (left: ${left:-nothing})"; tail_of "$out.log" 12; return
  fi
  if ! left="$(wait_clean 15)"; then
    result "$name" "$t0" 1 "$what: the job ended in $took s (exit $bg_rc) but left $left"; tail_of "$out.log" 12; return
  fi
  if [ "$bg_rc" = 0 ]; then result "$name" "$t0" 1 "$what: the job exited 0"; tail_of "$out.log"; return; fi
  if [ -n "$names" ]; then
    first="$(grep -m1 -E "$names" "$out.log" | sed 's/^ *//' || true)"
    if [ -z "$first" ]; then result "$name" "$t0" 1 "$what: no line names the lost host ($names)"; tail_of "$out.log" 12; return; fi
  else
    first="$({ grep -m1 -E "noticed that" "$out.log" || grep -m1 -iE "error|lost|killed|abort" "$out.log" || true; } | sed 's/^ *//')"
  fi
  result "$name" "$t0" 0 "$what: the job ended $took s later, exit $bg_rc, nothing left on the hosts; \"$first\""
}

# e: checkpoint, fault, resume ----------------------------------------------------------------------
case_e() {
  local t0 out="$work/e" tf p msg ok=0
  t0="$(now)"
  # At 10 mbit a tiny step takes about half a second (its gradients' all-reduce), so the rank is
  # killed between the checkpoints of steps 3 and 6.
  hs shape --rate 10mbit >/dev/null
  start_bg "$out" --preset tiny --steps 6 --checkpoint "$work/e.ckpt" --save-every 3 --attention cad
  if ! wait_for_line "$out.log" '^step +3/6' 60; then
    stop_bg; hs shape --clear >/dev/null || true
    result e.checkpoint-fault-resume "$t0" 1 "the 2-host run never printed step 3"; tail_of "$out.log"; return
  fi
  p="$(distca_pids 1)"
  noted="$(ns_pids 0) $(ns_pids 1)"
  tf="$(now)"
  # shellcheck disable=SC2086  # one word per pid
  [ -n "$p" ] && kill -KILL $p
  wait_end 30
  local took; took="$(since "$tf")"
  hs shape --clear >/dev/null
  if [ "$bg_rc" = -1 ]; then stop_bg; result e.checkpoint-fault-resume "$t0" 1 "the killed run did not end"; return; fi
  if grep -qE '^step +6/6' "$out.log" || [ -z "$p" ]; then
    result e.checkpoint-fault-resume "$t0" 1 "the rank was not killed between steps 3 and 6 (pid '${p}')"; tail_of "$out.log"; return
  fi
  if ! msg="$(wait_clean 15)"; then result e.checkpoint-fault-resume "$t0" 1 "the killed run left $msg"; return; fi
  local killed_rc="$bg_rc" last
  last="$(grep -E '^step +[0-9]+/6' "$out.log" | tail -1 | awk '{print $2}' || true)"
  if ! hosts_run "$work/hostfile2" 2 "$out.resume" --preset tiny --steps 6 --resume "$work/e.ckpt" --json "$out.resume.json" --attention cad; then
    result e.checkpoint-fault-resume "$t0" 1 "the resumed 2-host run failed"; tail_of "$out.resume.log"; return
  fi
  msg="$(python3 "$work/cmp.py" "$work/a.cad-2x2.local.json" "$out.resume.json" 4)" || ok=1
  result e.checkpoint-fault-resume "$t0" "$ok" "host 1's rank killed after step $last (the job ended $took s later, exit $killed_rc); resumed over 2 hosts from the step-3 checkpoint vs the uninterrupted local run: $msg"
}
case_e

# d: a host's rank killed ----------------------------------------------------------------------------
case_d() {
  local t0 tf p
  t0="$(now)"
  start_bg "$work/d.rank-killed" --preset tiny --steps 100000 --attention cad
  if ! wait_for_line "$work/d.rank-killed.log" '^step +1/' 60; then stop_bg; result d.rank-killed "$t0" 1 "no first step"; tail_of "$work/d.rank-killed.log"; return; fi
  noted="$(ns_pids 0) $(ns_pids 1)"
  p="$(distca_pids 1)"
  if [ -z "$p" ]; then stop_bg; result d.rank-killed "$t0" 1 "no distca process in ${prefix}1"; return; fi
  tf="$(now)"
  # shellcheck disable=SC2086  # one word per pid
  kill -KILL $p
  fault_verdict d.rank-killed "$t0" "$tf" "distca on ${prefix}1 (pid $p) killed"
}
case_d

# c: a dropped link --------------------------------------------------------------------------------
case_c() {  # case_c NAME [DISTCA ARGS]
  local name="$1" t0 tf; shift
  t0="$(now)"
  start_bg "$work/$name" --preset tiny --steps 100000 --attention cad "$@"
  if ! wait_for_line "$work/$name.log" '^step +1/' 60; then stop_bg; result "$name" "$t0" 1 "no first step"; tail_of "$work/$name.log"; return; fi
  noted="$(ns_pids 0) $(ns_pids 1)"
  tf="$(now)"
  hs link-down 1 >/dev/null
  fault_verdict "$name" "$t0" "$tf" "${prefix}1's link dropped${*:+ ($*)}" "node ${subnet//./\\.}\\.2\\b|error.*(rank 1\\b|${subnet//./\\.}\\.2\\b)"
  hs link-up 1 >/dev/null
}
case_c c.link-down
# distca's own short timeout: Open MPI's lost-daemon detection still ends the job first (about 11
# s), so the case repeats the one above; the soak run keeps it (scripts/test.sh --long).
if [ "${DISTCA_TEST_LONG:-0}" = 1 ]; then case_c c.link-down-timeout3 --timeout 3; fi

# ---- the end -----------------------------------------------------------------------------------
down_rc=0
down_out="$(hosts_down 2>&1)" || down_rc=$?
if [ "$down_rc" != 0 ]; then echo "FAIL: hosts.py down exited $down_rc: $down_out"; failed+=(down); keep_work=1; fi
left="$(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${prefix}[0-9]+\$" || true)$(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | grep -E "^${prefix}(br|v[0-9]+)(@|\$)" || true)"
[ ! -e "/run/distca-hosts/$prefix" ] || left+=" /run/distca-hosts/$prefix"
if [ -n "$left" ]; then echo "FAIL: hosts.py down left: $left"; failed+=(down); keep_work=1; fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all multi-host cases passed"
