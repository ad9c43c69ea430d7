#!/usr/bin/env bash
# The wlb/*.json of this report: distca simulate, one configuration at a time, with --paper's
# sampling (Pretrain: keep-short 0.5, upsample 4; ProLong: keep-short 0, elongation 1,
# full-context-share 0.3) and cp = GPUs / 8 / pp / sequences as --paper sets it.
set -euo pipefail
D=${DISTCA:-build/src/tools/distca}; W=${1:-reports/cpu/2026-11-28-simulate-paper/wlb}
PRE="--workload pretrain --keep-short 0.5 --upsample 4"
PRO="--workload prolong --keep-short 0 --elongation 1 --full-context-share 0.3"
C="--tp 8 --iterations 15 --json"
for cp in 32 16 8 4 2 1; do
  $D simulate --model llama-8b --gpus 256 --pp 1 --cp 2 --context 128K --batch 1 $PRE $C --system wlb --wlb-cp $cp > $W/8b-256-128k-pre-wlb$cp.json
done
$D simulate --model llama-8b --gpus 256 --pp 1 --cp 2 --context 128K --batch 1 $PRE $C --system cad-distca > $W/8b-256-128k-pre-cad-distca.json
for cp in 8 4; do
  $D simulate --model llama-8b --gpus 64 --pp 1 --cp 2 --context 128K --batch 1 $PRE $C --system wlb --wlb-cp $cp > $W/8b-64-128k-pre-wlb$cp.json
done
$D simulate --model llama-8b --gpus 64 --pp 1 --cp 2 --context 128K --batch 1 $PRE $C --system cad-distca > $W/8b-64-128k-pre-cad-distca.json
o() { n=$1; shift; $D simulate "$@" $C --system wlb > $W/out-$n.json; }  # WLB-ideal's pick
o 8b-256-128k-pre --model llama-8b --gpus 256 --pp 1 --cp 2 --context 128K --batch 1 $PRE
o 8b-256-256k-pre --model llama-8b --gpus 256 --pp 1 --cp 4 --context 256K --batch 1 $PRE
o 8b-256-128k-prolong --model llama-8b --gpus 256 --pp 1 --cp 2 --context 128K --batch 1 $PRO
o 8b-256-256k-prolong --model llama-8b --gpus 256 --pp 1 --cp 4 --context 256K --batch 1 $PRO
o 34b-256-128k-prolong --model llama-34b --gpus 256 --pp 1 --cp 8 --context 128K --batch 1 $PRO
o 34b-256-256k-prolong --model llama-34b --gpus 256 --pp 1 --cp 8 --context 256K --batch 1 $PRO
o 8b-512pp2-128k-pre --model llama-8b --gpus 512 --pp 2 --cp 2 --context 128K --batch 8 $PRE
$D simulate --model llama-8b --gpus 128 --pp 2 --cp 2 --context 128K --batch 8 $PRE $C --system all > $W/8b-128pp2-128k-pre-all.json
