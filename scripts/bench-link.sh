#!/usr/bin/env bash
# CAD over a real (shaped) network link between two test hosts (scripts/hosts.py: network
# namespaces joined by veth, one MPI rank per host, Open MPI over TCP), in one run:
#  1. the simulator's link model against the shaped link: `distca bench link` (one layer's four
#     CAD exchanges of a planned batch) at each --rates rate, predicted (latency measured in the
#     run + busiest bytes / rate) against measured;
#  2. ping-pong on a real link: `distca bench step --link off` (the demo's CAD step: sequential
#     nano-batches, ping-pong, the whole step, interleaved) over the link shaped so that a step's
#     attention exchange takes about its linear compute (the rate set from an unshaped
#     calibration run), alternating with the same benchmark over the unshaped link, --rounds
#     times. The time shaping adds to each variant's step, less what it adds to the gradient
#     all-reduce (which crosses the same link; with --grad-sync overlap, the default, what is left
#     of it when the backward ends), is the attention exchange's; hidden = 1 - (added to
#     ping-pong) / (added to sequential), and the same against the whole step (the same bytes,
#     nothing overlapped). --layers sets the step's layers (the first dispatch and the last return
#     of a step have nothing to hide behind: few layers, more of them).
#
#   scripts/bench-link.sh [--rates 0.1,0.3,1] [--rounds 3] [--steps 4] [--preset demo|tiny] [--layers N]
#                         [--progress poll|thread|none] [--progress-interval-us N] [--grad-sync overlap|eager|after]
#                         [--rate-mbit N (part 2's rate, not calibrated: runs to compare at one rate)] [--json F]
#
# Every flag is checked before any host is made: a bad one is one line on stderr, exit 2. Needs
# root (network namespaces); exits 77 where they cannot be made. The hosts are removed at the
# end, whatever happens. Progress goes to stderr, the summary to stdout, every figure to --json.
set -euo pipefail
caller_pwd="$(pwd)"
cd "$(dirname "$0")/.."
root="$(pwd)"

rates="0.1,0.3,1"; rounds=3; steps=4; json_out=""; preset="demo"; progress="poll"; layers=0; grad_sync="overlap"; interval_us=1000; fixed_rate=""
usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; }  # the header above
die() { echo "bench-link.sh: $*" >&2; exit 2; }
need_arg() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (--help)"; }
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --rates) need_arg "$@"; rates="$2"; shift 2 ;;
    --rounds) need_arg "$@"; rounds="$2"; shift 2 ;;
    --steps) need_arg "$@"; steps="$2"; shift 2 ;;
    --preset) need_arg "$@"; preset="$2"; shift 2 ;;
    --layers) need_arg "$@"; layers="$2"; shift 2 ;;
    --progress) need_arg "$@"; progress="$2"; shift 2 ;;
    --grad-sync) need_arg "$@"; grad_sync="$2"; shift 2 ;;
    --progress-interval-us) need_arg "$@"; interval_us="$2"; shift 2 ;;
    --rate-mbit) need_arg "$@"; fixed_rate="$2"; shift 2 ;;
    --json) need_arg "$@"; json_out="$2"; shift 2 ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;;
    *) die "unknown option '$1' (--help)" ;;
  esac
done
# Every flag is checked here, before any host is made (exit 2, one line).
bad_rates="--rates must be Gbit/s values 0.001..100 separated by commas, e.g. 0.1,0.3,1 (got '$rates')"
[[ "$rates" =~ ^[^,](.*[^,])?$ && "$rates" != *,,* ]] || die "$bad_rates"
for r in ${rates//,/ }; do  # each becomes hosts.py's --rate in Mbit/s ("%g"): 0.001..100 Gbit/s keeps it plain
  [[ "$r" =~ ^(0|[1-9][0-9]*)(\.[0-9]+)?$ ]] && awk -v r="$r" 'BEGIN {exit !(r >= 0.001 && r <= 100)}' || die "$bad_rates"
done
[[ "$rounds" =~ ^[1-9][0-9]?$ ]] || die "--rounds must be 1..99 (got '$rounds')"
[[ "$steps" =~ ^[1-9][0-9]?$ ]] || die "--steps must be 1..99 (got '$steps')"
[[ "$preset" =~ ^(tiny|demo)$ ]] || die "--preset must be tiny or demo, distca bench step's presets (got '$preset')"
[[ "$layers" =~ ^([0-9]|[1-5][0-9]|6[0-4])$ ]] || die "--layers must be 0..64, 0 for the preset's (got '$layers')"
[[ "$progress" =~ ^(poll|thread|none)$ ]] || die "--progress must be poll, thread or none (got '$progress')"
[[ "$grad_sync" =~ ^(overlap|eager|after)$ ]] || die "--grad-sync must be overlap, eager or after (got '$grad_sync')"
[[ "$interval_us" =~ ^[1-9][0-9]{1,5}$ ]] && [ "$interval_us" -le 100000 ] ||
  die "--progress-interval-us must be 10..100000 (got '$interval_us')"
[ -z "$fixed_rate" ] || { [[ "$fixed_rate" =~ ^[1-9][0-9]{0,5}$ ]] && [ "$fixed_rate" -le 100000 ]; } ||
  die "--rate-mbit must be 1..100000 Mbit/s (got '$fixed_rate')"
if [ -n "$json_out" ]; then  # written at the very end: a path that cannot be written would lose the run
  case "$json_out" in /*) ;; *) json_out="$caller_pwd/$json_out" ;; esac
  [ ! -d "$json_out" ] || die "--json $json_out is a folder, not a file"
  [ -d "$(dirname "$json_out")" ] && [ -w "$(dirname "$json_out")" ] || die "--json $json_out: $(dirname "$json_out") is not a writable folder"
fi
distca="$root/build/src/tools/distca"
[ -x "$distca" ] || die "$distca is not built (scripts/build.sh)"
command -v mpirun >/dev/null 2>&1 || die "no mpirun (scripts/install-deps.sh installs Open MPI)"
command -v python3 >/dev/null 2>&1 || die "no python3 for the summary"

prefix="dbl"; subnet="10.79.0"
work="$(mktemp -d "${TMPDIR:-/tmp}/distca-bench-link.XXXXXX")"
hosts() { "$root/scripts/hosts.py" "$@" --prefix "$prefix"; }
cleanup() { hosts down --dir "$work/hosts" >/dev/null || true; rm -rf "$work"; }  # down names on stderr anything it cannot remove
trap cleanup EXIT INT TERM
say() { echo "[bench-link $(date +%T)] $*" >&2; }

set +e
hosts up 2 --subnet "$subnet" --dir "$work/hosts" --slots 1 >&2
rc=$?
set -e
[ "$rc" = 77 ] && exit 77
[ "$rc" = 0 ] || { echo "bench-link.sh: scripts/hosts.py up failed (exit $rc)" >&2; exit 1; }
# shellcheck disable=SC1091
source "$work/hosts/hosts.env"
run2() {  # one rank on each host
  # shellcheck disable=SC2086
  mpirun --allow-run-as-root --oversubscribe --bind-to none -q $DISTCA_MPIRUN_HOST_FLAGS \
    --hostfile "$DISTCA_HOSTS_HOSTFILE" --map-by node -np 2 "$@"
}

# 1. The link model at each rate.
i=0
for r in ${rates//,/ }; do
  hosts shape --rate "$(awk -v r="$r" 'BEGIN { printf "%gmbit", r * 1000 }')" >&2
  say "bench link at $r Gbit/s"
  run2 "$distca" bench link --rate-gbit "$r" --workload prolong --tokens-per-rank 16384 --repeats 5 --json \
    > "$work/link_$i.json"
  i=$((i + 1))
done
hosts shape --clear >&2

# 2. Ping-pong: calibrate on the unshaped link, then alternate shaped and unshaped runs.
if [ -n "$fixed_rate" ]; then
  rate_mbit="$fixed_rate"
  say "shaped rate: ${rate_mbit} Mbit/s (--rate-mbit)"
else
say "calibration: bench step over the unshaped link"
run2 "$distca" bench step --link off --preset "$preset" --layers "$layers" --steps 2 --json > "$work/cal.json"
rate_mbit="$(python3 - "$work/cal.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
linear = j["sequential_linear_seconds"]["median"]
per_rank = j["sequential_attention_bytes"]["median"] / j["ranks"]  # each rank's share, one direction
print(f"{max(1.0, 8 * per_rank / linear / 1e6):.0f}")
EOF
)"
say "shaped rate: ${rate_mbit} Mbit/s (a step's attention bytes per rank / its linear seconds)"
fi
for k in $(seq 1 "$rounds"); do
  hosts shape --rate "${rate_mbit}mbit" >&2
  say "round $k/$rounds: shaped"
  run2 "$distca" bench step --link off --preset "$preset" --layers "$layers" --steps "$steps" --progress "$progress" --progress-interval-us "$interval_us" --grad-sync "$grad_sync" --json > "$work/shaped_$k.json"
  hosts shape --clear >&2
  say "round $k/$rounds: unshaped"
  run2 "$distca" bench step --link off --preset "$preset" --layers "$layers" --steps "$steps" --progress "$progress" --progress-interval-us "$interval_us" --grad-sync "$grad_sync" --json > "$work/unshaped_$k.json"
done

python3 - "$work" "$rates" "$rounds" "$rate_mbit" "$progress" "${json_out:-}" "$grad_sync" "$interval_us" <<'EOF'
import json, statistics, sys
work, rates, rounds, rate_mbit, progress, out, grad_sync, interval_us = (
    sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6], sys.argv[7],
    int(sys.argv[8]))
report = {"benchmark": "bench-link.sh", "hosts": 2, "ranks_per_host": 1, "progress": progress,
          "progress_interval_us": interval_us, "grad_sync": grad_sync,
          "link_model": [], "pingpong": {}}
print("1. the simulator's link model (latency + busiest rank's bytes / rate) against the shaped link: one layer's "
      "four CAD exchanges of a prolong batch, 16K tokens per rank, medians of 5")
print(f"{'rate Gbit/s':>11} {'latency us':>10} {'busiest MB':>10} {'measured s':>10} {'predicted s':>11} {'meas/pred':>9}")
for i, r in enumerate(rates):
    j = json.load(open(f"{work}/link_{i}.json"))
    mb = sum(p["busiest_rank_bytes"] for p in j["phases"]) / 1e6
    row = {"rate_gbit": float(r), "latency_seconds": j["latency_seconds"]["median"], "busiest_megabytes": mb,
           "measured_seconds": j["layer_seconds"], "predicted_seconds": j["predicted_layer_seconds"],
           "measured_over_predicted": j["layer_measured_over_predicted"],
           "phases": j["phases"]}
    report["link_model"].append(row)
    print(f"{float(r):>11g} {1e6 * row['latency_seconds']:>10.0f} {mb:>10.2f} {j['layer_seconds']['median']:>10.4f} "
          f"{row['predicted_seconds']:>11.4f} {row['measured_over_predicted']:>9.3f}")
worst = max(abs(x["measured_over_predicted"] - 1) for x in report["link_model"])
report["link_model_worst_error"] = worst
print(f"worst |measured / predicted - 1|: {100 * worst:.1f}% (target 15%)")

def med(name, key):
    return statistics.median(json.load(open(f"{work}/{name}_{k}.json"))[key]["median"] for k in range(1, rounds + 1))
V = ("sequential", "pingpong", "whole")
s = {v: med("shaped", f"{v}_seconds") for v in V}
u = {v: med("unshaped", f"{v}_seconds") for v in V}
rs = {v: med("shaped", f"{v}_grad_reduce_seconds") for v in V}
ru = {v: med("unshaped", f"{v}_grad_reduce_seconds") for v in V}
lin = med("shaped", "sequential_linear_seconds")
comm_s, comm_u = med("shaped", "sequential_comm_seconds"), med("unshaped", "sequential_comm_seconds")
# What the shaped link adds to each variant's step, less what it adds to the gradient all-reduce
# (which crosses the same link and no attention schedule can hide): the attention exchange's share.
added = {v: (s[v] - u[v]) - (rs[v] - ru[v]) for v in V}
hidden = 1 - added["pingpong"] / added["sequential"] if added["sequential"] > 0 else None
# The same against the whole step, which moves the same bytes (one plan) with nothing overlapped:
# the sequential baseline also waits, at every exchange, for whichever rank has more of that
# nano-batch's work, and the link's time overlaps that wait.
hidden_whole = 1 - added["pingpong"] / added["whole"] if added["whole"] > 0 else None
report["pingpong"] = {"rate_mbit": rate_mbit, "rounds": rounds, "shaped_seconds": s, "unshaped_seconds": u,
                      "grad_reduce_seconds_shaped": rs, "grad_reduce_seconds_unshaped": ru,
                      "linear_seconds": lin, "comm_seconds_shaped": comm_s, "comm_seconds_unshaped": comm_u,
                      "attention_link_added_seconds": added, "hidden_fraction": hidden,
                      "hidden_fraction_against_whole": hidden_whole,
                      "pingpong_shaped_over_unshaped": s["pingpong"] / u["pingpong"],
                      "pingpong_shaped_over_unshaped_without_grad_reduce":
                          (s["pingpong"] - rs["pingpong"]) / (u["pingpong"] - ru["pingpong"]),
                      "pingpong_over_sequential_shaped": s["pingpong"] / s["sequential"]}
print()
first = json.load(open(f"{work}/shaped_1.json"))
report["pingpong_step"] = {"preset": first["preset"], "layers": first["model"]["num_layers"], "context": first["context"]}
print(f"2. ping-pong on a real link: the {first['preset']} CAD step ({first['model']['num_layers']} layers), one rank per "
      f"host, --progress {progress}" + (f" every {interval_us} us" if progress == "thread" else "") +
      f", --grad-sync {grad_sync}, link shaped to {rate_mbit:g} Mbit/s (attention bytes per rank per step / linear seconds); medians over "
      f"{rounds} alternating rounds of the per-run medians")
print(f"{'':34} {'sequential':>10} {'ping-pong':>10} {'whole':>10}")
print(f"{'shaped link: step (s)':34} {s['sequential']:>10.3f} {s['pingpong']:>10.3f} {s['whole']:>10.3f}")
print(f"{'  of it, all-reduce waited for (s)':34} {rs['sequential']:>10.3f} {rs['pingpong']:>10.3f} {rs['whole']:>10.3f}")
print(f"{'unshaped link: step (s)':34} {u['sequential']:>10.3f} {u['pingpong']:>10.3f} {u['whole']:>10.3f}")
print(f"{'  of it, all-reduce waited for (s)':34} {ru['sequential']:>10.3f} {ru['pingpong']:>10.3f} {ru['whole']:>10.3f}")
print(f"{'shaping adds, all-reduce aside (s)':34} {added['sequential']:>10.3f} {added['pingpong']:>10.3f} {added['whole']:>10.3f}")
print(f"linear compute {lin:.3f} s; the sequential step's communication {comm_s:.3f} s shaped, {comm_u:.3f} s unshaped")
print("hidden: " + (f"{100 * hidden:.0f}% of the attention exchange time the shaped link adds to the sequential step "
                    f"({added['sequential']:.3f} s) does not show in the ping-pong step (target 70%)"
                    if hidden is not None else "not measurable (the shaped link added no attention time)"))
print("hidden against the whole step: " + (f"{100 * hidden_whole:.0f}% of the time the shaped link adds to the whole step "
                                           f"({added['whole']:.3f} s: the same bytes, nothing overlapped) does not show in "
                                           "the ping-pong step" if hidden_whole is not None else "not measurable"))
print(f"ping-pong shaped / unshaped: {report['pingpong']['pingpong_shaped_over_unshaped']:.3f}; without the gradient "
      f"all-reduce: {report['pingpong']['pingpong_shaped_over_unshaped_without_grad_reduce']:.3f} (target 1.15)")
faster = s["pingpong"] < s["whole"]
report["pingpong"]["pingpong_over_whole_shaped"] = s["pingpong"] / s["whole"]
print(f"over the shaped link ping-pong is {'faster' if faster else 'NOT faster'} than the whole step: "
      f"{s['pingpong']:.3f} s against {s['whole']:.3f} s ({s['pingpong'] / s['whole']:.3f}x)")
ratio = max(json.load(open(f"{work}/{name}_{k}.json"))["pingpong_over_whole_bytes_max"]
            for name in ("shaped", "unshaped") for k in range(1, rounds + 1))
report["pingpong"]["pingpong_over_whole_bytes_max"] = ratio
print(f"ping-pong's attention bytes per step: at most {ratio:.3f}x the whole step's (one plan split; target 1.05)")
if out:
    json.dump(report, open(out, "w"), indent=2)
    print(f"wrote {out}")
EOF
