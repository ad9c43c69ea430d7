#!/usr/bin/env bash
# distca.torch's ping-pong over a real (shaped) network link, in one run: two test hosts
# (scripts/hosts.py: network namespaces joined by veth), one gloo process on each
# (`ip netns exec`, torch.distributed over TCP to the first host's address), running
# python/bench/bench_link_torch.py (CAD attention of --layers layers, forward and backward,
# sequential and ping-pong interleaved on the same batches):
#  1. calibration over the unshaped link: the rate at which a step's attention exchange (each
#     phase's busier sender's bytes, phase after phase) takes as long as its attention compute
#     (the busiest rank's server-kernel seconds), unless --rate-mbit gives one;
#  2. --rounds rounds, each the benchmark over the link shaped to that rate, then over the
#     unshaped link. Per variant: the step's seconds shaped and unshaped (medians over the rounds
#     of each run's median), what shaping adds, how much of the sequential step's added time
#     ping-pong hides (hidden = 1 - added to ping-pong / added to sequential), and whether
#     ping-pong is faster than sequential over the shaped link.
#
#   scripts/bench-link-torch.sh [--rounds 3] [--steps 4] [--layers 2] [--tokens 4096]
#                               [--workload two-long|skewed|prolong|wlbllm] [--rate-mbit auto|R]
#                               [--json F]
#
# Every flag is checked before any host is made: a bad one is one line on stderr, exit 2. Needs
# root (network namespaces); exits 77 where they cannot be made. The hosts are removed at the
# end, whatever happens. Progress goes to stderr, the summary to stdout, every figure to --json.
set -euo pipefail
caller_pwd="$(pwd)"
cd "$(dirname "$0")/.."
root="$(pwd)"

rounds=3; steps=4; layers=2; tokens=4096; workload="two-long"; rate="auto"; json_out=""
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }  # the header above
die() { echo "bench-link-torch.sh: $*" >&2; exit 2; }
need_arg() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (--help)"; }
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --rounds) need_arg "$@"; rounds="$2"; shift 2 ;;
    --steps) need_arg "$@"; steps="$2"; shift 2 ;;
    --layers) need_arg "$@"; layers="$2"; shift 2 ;;
    --tokens) need_arg "$@"; tokens="$2"; shift 2 ;;
    --workload) need_arg "$@"; workload="$2"; shift 2 ;;
    --rate-mbit) need_arg "$@"; rate="$2"; shift 2 ;;
    --json) need_arg "$@"; json_out="$2"; shift 2 ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;;
    *) die "unknown option '$1' (--help)" ;;
  esac
done
# Every flag is checked here, before any host is made (exit 2, one line).
[[ "$rounds" =~ ^[1-9][0-9]?$ ]] || die "--rounds must be 1..99 (got '$rounds')"
[[ "$steps" =~ ^[1-9][0-9]?$ ]] || die "--steps must be 1..99 (got '$steps')"
[[ "$layers" =~ ^[1-9][0-9]?$ ]] && [ "$layers" -le 64 ] || die "--layers must be 1..64 (got '$layers')"
[[ "$tokens" =~ ^[1-9][0-9]{2,4}$ ]] && [ "$tokens" -ge 256 ] && [ "$tokens" -le 65536 ] && [ $((tokens % 16)) = 0 ] ||
  die "--tokens must be a multiple of 16 in 256..65536 tokens per rank (got '$tokens')"
[[ "$workload" =~ ^(two-long|skewed|prolong|wlbllm)$ ]] ||
  die "--workload must be two-long, skewed, prolong or wlbllm (got '$workload')"
[[ "$rate" = auto || ( "$rate" =~ ^[1-9][0-9]{0,5}$ && "$rate" -le 100000 ) ]] ||
  die "--rate-mbit must be auto or whole Mbit/s 1..100000 (got '$rate')"
if [ -n "$json_out" ]; then  # written at the very end: a path that cannot be written would lose the run
  case "$json_out" in /*) ;; *) json_out="$caller_pwd/$json_out" ;; esac
  [ ! -d "$json_out" ] || die "--json $json_out is a folder, not a file"
  [ -d "$(dirname "$json_out")" ] && [ -w "$(dirname "$json_out")" ] || die "--json $json_out: $(dirname "$json_out") is not a writable folder"
fi
py="$root/.venv/bin/python"
[ -x "$py" ] || die "$py is missing (scripts/install-python.sh makes .venv)"
if [[ "$workload" =~ ^(prolong|wlbllm)$ ]]; then
  shared="${DISTCA_SHARED_DATA:-$root/../shared/data}"
  [ -f "$shared/dist_$workload.json" ] || die "--workload $workload needs $shared/dist_$workload.json (DISTCA_SHARED_DATA)"
  DISTCA_SHARED_DATA="$(cd "$shared" && pwd)"
  export DISTCA_SHARED_DATA
fi

prefix="dblt"; subnet="10.83.54"   # bench-link.sh uses dbl / 10.79.0: both can run at once
work="$(mktemp -d "${TMPDIR:-/tmp}/distca-bench-link-torch.XXXXXX")"
hosts() { "$root/scripts/hosts.py" "$@" --prefix "$prefix"; }
pids=()
cleanup() {
  for p in ${pids[@]+"${pids[@]}"}; do kill "$p" 2>/dev/null || true; done  # our ranks only, by id
  hosts down --dir "$work/hosts" >/dev/null || true  # down names on stderr anything it cannot remove
  rm -rf "$work"
}
trap cleanup EXIT INT TERM
say() { echo "[bench-link-torch $(date +%T)] $*" >&2; }

set +e
hosts up 2 --subnet "$subnet" --dir "$work/hosts" --slots 1 >&2
rc=$?
set -e
[ "$rc" = 77 ] && exit 77
[ "$rc" = 0 ] || { echo "bench-link-torch.sh: scripts/hosts.py up failed (exit $rc)" >&2; exit 1; }
# shellcheck disable=SC1091
source "$work/hosts/hosts.env"
read -r -a namespaces <<< "$DISTCA_HOSTS_NAMESPACES"
read -r -a addrs <<< "$DISTCA_HOSTS_ADDRS"

port=29610
run2() {  # run2 NAME STEPS: one rank in each host; rank 0's JSON in $work/NAME.json
  local name="$1" n="$2" k rc=0
  port=$((port + 1))   # a fresh port per run: the last one may still be in TIME_WAIT
  pids=()
  for k in 0 1; do
    ip netns exec "${namespaces[k]}" env RANK="$k" WORLD_SIZE=2 MASTER_ADDR="${addrs[0]}" MASTER_PORT="$port" \
      GLOO_SOCKET_IFNAME="$DISTCA_HOSTS_IFACE" OMP_NUM_THREADS=1 \
      timeout 900 "$py" "$root/python/bench/bench_link_torch.py" --steps "$n" --layers "$layers" --tokens "$tokens" \
      --workload "$workload" > "$work/$name.r$k.out" 2> "$work/$name.r$k.err" &
    pids+=("$!")
  done
  # The first rank to fail ends the other (it would wait for its peer until the timeout).
  local left=("${pids[@]}") finished p
  while [ ${#left[@]} -gt 0 ]; do
    finished=""
    if ! wait -n -p finished "${left[@]}"; then
      rc=1
      for p in "${left[@]}"; do kill "$p" 2>/dev/null || true; done
    fi
    for p in "${!left[@]}"; do [ "${left[p]}" != "$finished" ] || unset 'left[p]'; done
    [ -n "$finished" ] || break   # nothing left to wait for
  done
  pids=()
  if [ "$rc" != 0 ]; then
    echo "bench-link-torch.sh: $name: a rank failed (exit $rc); its last lines:" >&2
    tail -n 5 "$work/$name.r0.err" "$work/$name.r1.err" >&2
    exit 1
  fi
  cp "$work/$name.r0.out" "$work/$name.json"
}

# 1. Calibration on the unshaped link.
if [ "$rate" = auto ]; then
  say "calibration: the benchmark over the unshaped link"
  run2 cal 2
  rate="$("$py" - "$work/cal.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))["variants"]["sequential"]["median"]
# each phase's busier sender's bytes, phase after phase, through a link that passes them in the
# attention compute's seconds
print(f"{max(1.0, 8 * j['link_bytes'] / j['kernel_seconds'] / 1e6):.0f}")
EOF
)"
  say "shaped rate: $rate Mbit/s (a step's attention bytes, each phase's busier sender's / the attention compute's seconds)"
fi
# 2. Rounds: shaped, then unshaped.
for k in $(seq 1 "$rounds"); do
  hosts shape --rate "${rate}mbit" >&2
  say "round $k/$rounds: shaped to $rate Mbit/s"
  run2 "shaped_$k" "$steps"
  hosts shape --clear >&2
  say "round $k/$rounds: unshaped"
  run2 "unshaped_$k" "$steps"
done

"$py" - "$work" "$rounds" "$rate" "${json_out:-}" <<'EOF'
import json, statistics, sys
work, rounds, rate, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
runs = {kind: [json.load(open(f"{work}/{kind}_{k}.json")) for k in range(1, rounds + 1)] for kind in ("shaped", "unshaped")}
first = runs["shaped"][0]
V = ("sequential", "pingpong")
def med(kind, v, key):
    return statistics.median(r["variants"][v]["median"][key] for r in runs[kind])
s = {v: med("shaped", v, "seconds") for v in V}
u = {v: med("unshaped", v, "seconds") for v in V}
kernel = {v: med("unshaped", v, "kernel_seconds") for v in V}
sent = {v: med("unshaped", v, "max_rank_bytes") for v in V}
link = {v: med("unshaped", v, "link_bytes") for v in V}
added = {v: s[v] - u[v] for v in V}
hidden = 1 - added["pingpong"] / added["sequential"] if added["sequential"] > 0 else None
split = runs["unshaped"][0]["variants"]["pingpong"]["median"]
report = {"benchmark": "bench-link-torch.sh", "hosts": 2, "ranks_per_host": 1, "rate_mbit": rate, "rounds": rounds,
          "workload": first["workload"], "tokens_per_rank": first["tokens_per_rank"], "layers": first["layers"],
          "steps": first["steps"], "model": first["model"], "dtype": first["dtype"], "kernel": first["kernel"],
          "policy": first["policy"], "shaped_seconds": s, "unshaped_seconds": u, "kernel_seconds_unshaped": kernel,
          "max_rank_bytes_per_step": sent, "link_bytes_per_step": link, "added_by_shaping_seconds": added,
          "link_seconds_at_rate": {v: 8 * link[v] / (rate * 1e6) for v in V}, "hidden_fraction": hidden,
          "pingpong_over_sequential_shaped": s["pingpong"] / s["sequential"],
          "pingpong_over_sequential_unshaped": u["pingpong"] / u["sequential"],
          "pingpong_faster_shaped": s["pingpong"] < s["sequential"],
          "split": {k: split.get(k) for k in ("cuts", "extra_kv_rows", "remote_kv_rows", "level_over_cap",
                                              "stages_over_whole", "part_bytes")},
          "runs": runs}
print(f"distca.torch ping-pong over a real link: {first['workload']} batches, {first['tokens_per_rank']} tokens per "
      f"rank, {first['layers']} attention layers (Hq {first['model']['heads']}, Hkv {first['model']['kv_heads']}, "
      f"D {first['model']['head_dim']}, {first['dtype']}, kernel {first['kernel']}), one gloo process on each of 2 "
      f"hosts; link shaped to {rate:g} Mbit/s; medians over {rounds} alternating rounds of each run's median of "
      f"{first['steps']} steps")
print(f"{'':38} {'sequential':>10} {'ping-pong':>10}")
print(f"{'shaped link: step (s)':38} {s['sequential']:>10.3f} {s['pingpong']:>10.3f}")
print(f"{'unshaped link: step (s)':38} {u['sequential']:>10.3f} {u['pingpong']:>10.3f}")
print(f"{'shaping adds (s)':38} {added['sequential']:>10.3f} {added['pingpong']:>10.3f}")
print(f"{'attention compute, unshaped (s)':38} {kernel['sequential']:>10.3f} {kernel['pingpong']:>10.3f}")
print(f"{'busier rank sends per step (MB)':38} {sent['sequential'] / 1e6:>10.2f} {sent['pingpong'] / 1e6:>10.2f}")
print(f"{'phases busier senders, per step (MB)':38} {link['sequential'] / 1e6:>10.2f} {link['pingpong'] / 1e6:>10.2f}")
print(f"{'  their time at the shaped rate (s)':38} {8 * link['sequential'] / rate / 1e6:>10.3f} "
      f"{8 * link['pingpong'] / rate / 1e6:>10.3f}")
print(f"ping-pong's split: {split.get('cuts', 0):g} cut(s), {split.get('extra_kv_rows', 0):g} of {split.get('remote_kv_rows', 0):g} "
      f"travelling K/V rows sent twice, level {split.get('level_over_cap', 1):.3f} x cap, its two attention stages "
      f"{split.get('stages_over_whole', 1):.3f} x the plan's one")
# Per step, the larger nano-batch's share of the bytes: the other one's exchanges are all that can
# run during its compute, and the first dispatch and the last return never overlap anything.
shares = [max(r["part_bytes"]) / sum(r["part_bytes"]) for kind in runs for run in runs[kind]
          for r in run["variants"]["pingpong"]["steps"] if sum(r.get("part_bytes", [0]))]
report["larger_nano_batch_byte_share"] = statistics.median(shares) if shares else None
if shares:
    print(f"the nano-batch that moves more carries {100 * statistics.median(shares):.0f} % of a step's bytes (median "
          f"over steps; {100 * min(shares):.0f}-{100 * max(shares):.0f} %)")
print("hidden: " + (f"{100 * hidden:.0f}% of the time the shaped link adds to the sequential step "
                    f"({added['sequential']:.3f} s) does not show in the ping-pong step"
                    if hidden is not None else "not measurable (the shaped link added no time to the sequential step)"))
verdict = "FASTER" if report["pingpong_faster_shaped"] else "NOT faster"
print(f"ping-pong over the shaped link: {s['pingpong']:.3f} s against {s['sequential']:.3f} s sequential "
      f"({report['pingpong_over_sequential_shaped']:.3f}x): {verdict}; unshaped {report['pingpong_over_sequential_unshaped']:.3f}x")
if out:
    json.dump(report, open(out, "w"), indent=2)
    print(f"wrote {out}")
EOF
