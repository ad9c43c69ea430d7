"""Hugging Face Trainer with CAD attention (distca.torch.adapters.transformers), against HF's own sdpa.

    torchrun --nproc-per-node 2 examples/hf_trainer_cad.py                 # CPU (gloo); CUDA: --device cuda
    torchrun --nproc-per-node 2 examples/hf_trainer_cad.py --steps 20 --tokens-per-rank 4096 --json run.json

Trains a small Llama model built from a config (no download) on packed rows of documents whose
lengths are drawn from a real sample (--lengths: the DistCA paper's Pretrain distribution in
../shared/data/dist_wlbllm.json by default, each length scaled by tokens-per-rank / 64K, as the
paper elongates them to its context), collated by transformers' DataCollatorWithFlattening into
one row per rank and step (position_ids restarting at 0 and, with --form cu, cu_seq_lens_q/k).
Runs the Trainer twice from the same weights and data order: with CAD (the config's use_cache left
as it is: CAD is right whatever it says), then with HF's sdpa and use_cache=False (HF's packed
attention is right only without a cache). Prints a line per step (rank 0: the loss averaged over the
ranks, the step's seconds, and the CAD plan's attention balance: the planner's estimate of the
busiest rank's attention work over the mean, before and after planning) and the final losses.
Exit status: 0 when both runs ended, 1 when a run failed, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LENGTHS = ROOT.parent / "shared" / "data" / "dist_wlbllm.json"
PAPER_CONTEXT = 65536   # the length the sample's documents are scaled from


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Run it under torchrun (--nproc-per-node N); one process trains alone.")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    p.add_argument("--tokens-per-rank", type=int, default=2048, help="tokens in each rank's packed row (default 2048)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--adam-epsilon", type=float, default=1e-4,
                   help="AdamW's eps (default 1e-4: near-zero gradient entries, where two correct attentions "
                        "round differently, are not amplified to +-lr, so the two runs stay comparable)")
    p.add_argument("--form", choices=("positions", "cu"), default="cu",
                   help="the packed batch: position_ids alone (TRL's padding_free) or with cu_seq_lens_q/k "
                        "(DataCollatorWithFlattening(return_flash_attn_kwargs=True), the default)")
    p.add_argument("--attention", choices=("both", "cad", "sdpa"), default="both")
    p.add_argument("--policy", default="minlink", help="the CAD planner's policy (default minlink)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--lengths", type=Path, default=DEFAULT_LENGTHS,
                   help="a JSON array of document lengths in tokens (default ../shared/data/dist_wlbllm.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", type=Path, help="write the report here (rank 0; refuses to overwrite a file)")
    a = p.parse_args(argv)
    for name in ("steps", "tokens_per_rank", "layers", "hidden", "heads", "kv_heads", "vocab"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    if a.hidden % a.heads or a.heads % a.kv_heads:
        p.error(f"--hidden ({a.hidden}) must be a multiple of --heads ({a.heads}), and --heads of --kv-heads ({a.kv_heads})")
    if not (a.lr > 0 and math.isfinite(a.lr)) or not (a.adam_epsilon > 0 and math.isfinite(a.adam_epsilon)):
        p.error("--lr and --adam-epsilon must be positive numbers")
    if a.json is not None and a.json.exists():
        p.error(f"--json {a.json} exists; give a new path")
    return a


def read_lengths(path: Path) -> list:
    try:
        lengths = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"hf_trainer_cad.py: no document-length sample at {path} (--lengths: a JSON array of "
                         f"document lengths, e.g. ../shared/data/dist_wlbllm.json)")
    except (OSError, ValueError) as e:
        raise SystemExit(f"hf_trainer_cad.py: cannot read {path}: {e}")
    if not isinstance(lengths, list) or not lengths or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in lengths):
        raise SystemExit(f"hf_trainer_cad.py: {path} must hold a JSON array of positive integers")
    return lengths


def packed_rows(lengths: list, rows: int, tokens: int, vocab: int, seed: int) -> list:
    """`rows` rows of exactly `tokens` tokens, each documents drawn from the sample (lengths scaled by
    tokens / 64K, at least 2) end to end, the last one cut at the row's end; random token ids."""
    import numpy as np
    rng = np.random.default_rng(seed)
    scale = tokens / PAPER_CONTEXT
    out = []
    for _ in range(rows):
        docs, left = [], tokens
        while left > 0:
            n = min(left, max(2, round(int(lengths[rng.integers(len(lengths))]) * scale)))
            docs.append(rng.integers(0, vocab, size=n).tolist())
            left -= n
        out.append({"docs": docs})
    return out


class RowCollator:
    """One packed row a batch (per_device_train_batch_size 1): its documents flattened by
    DataCollatorWithFlattening (labels -100 at each document's first token)."""

    def __init__(self, form: str):
        from transformers import DataCollatorWithFlattening
        self.flatten = DataCollatorWithFlattening(return_flash_attn_kwargs=form == "cu", return_position_ids=True)

    def __call__(self, features: list) -> dict:
        if len(features) != 1:
            raise ValueError(f"one packed row per rank and step, got {len(features)}")
        return self.flatten([{"input_ids": d} for d in features[0]["docs"]])


def train(a: argparse.Namespace, attention: str, rows: list, say) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=max(4096, a.tokens_per_rank))
    cfg._attn_implementation = "sdpa"
    if attention == "sdpa":
        cfg.use_cache = False
    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(cfg)
    if a.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    cad = None
    if attention == "cad":
        from distca.torch.adapters.transformers import apply_cad, cad_state
        apply_cad(model, policy=a.policy)
        cad = cad_state(model)
    losses, lines = [], []

    class StepLines(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "loss" not in logs:
                return
            line = {"step": state.global_step, "loss": float(logs["loss"]), "seconds": time.perf_counter() - self.t0}
            if cad is not None and cad.layout is not None:
                report = cad.layout.plan.report()
                line["plan_imbalance_before"] = float(report["load_before"]["imbalance"])
                line["plan_imbalance_after"] = float(report["load_after"]["imbalance"])
            losses.append(line["loss"])
            lines.append(line)
            balance = (f"  CAD plan: attention imbalance {line['plan_imbalance_before']:.2f} -> "
                       f"{line['plan_imbalance_after']:.2f} (planner's estimate, max/mean over ranks)"
                       if "plan_imbalance_after" in line else "")
            say(f"{attention:>4} step {state.global_step}/{a.steps}  loss {line['loss']:.6f}  "
                f"{line['seconds']:.2f} s{balance}")

    with tempfile.TemporaryDirectory(prefix="hf-trainer-cad-") as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=1, max_steps=a.steps,
                                 learning_rate=a.lr, adam_epsilon=a.adam_epsilon, lr_scheduler_type="constant",
                                 warmup_steps=0, weight_decay=0.0, logging_steps=1, logging_first_step=True,
                                 report_to=[], save_strategy="no", remove_unused_columns=False,
                                 use_cpu=a.device == "cpu", ddp_backend="gloo" if a.device == "cpu" else "nccl",
                                 seed=a.seed, data_seed=a.seed, disable_tqdm=True, log_level="warning",
                                 dataloader_num_workers=0, logging_nan_inf_filter=False)
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=RowCollator(a.form),
                          callbacks=[StepLines()])
        trainer.remove_callback(PrinterCallback)   # StepLines prints the steps
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    result = {"attention": attention, "losses": losses, "final_loss": losses[-1] if losses else None,
              "seconds": seconds, "steps": lines}
    if cad is not None:
        result.update(plans=cad.plans, forwards=cad.forwards)
        cad.finish()   # every rank ran the same forwards; lets the adapter's process groups go
    return result


def main(argv=None) -> int:
    a = parse_args(argv)
    lengths = read_lengths(a.lengths)
    import torch
    import torch.distributed as dist
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29561"))
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("hf_trainer_cad.py: --device cuda, but PyTorch sees no GPU")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    rows = packed_rows(lengths, a.steps * world, a.tokens_per_rank, a.vocab, a.seed)
    say(f"hf_trainer_cad.py: {world} ranks, {a.steps} steps of {a.tokens_per_rank} tokens a rank, documents from "
        f"{a.lengths.name} scaled by {a.tokens_per_rank}/{PAPER_CONTEXT} ({sum(len(r['docs']) for r in rows)} documents), "
        f"Llama {a.layers} layers hidden {a.hidden} heads {a.heads}/{a.kv_heads}, form {a.form}")
    runs = {}
    try:
        for attention in (("cad", "sdpa") if a.attention == "both" else (a.attention,)):
            runs[attention] = train(a, attention, rows, say)
    except Exception as e:  # noqa: BLE001 (one line, exit 1)
        print(f"hf_trainer_cad.py: rank {rank}: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    report = {"format": "distca-hf-trainer", "ranks": world, "args": {k: str(v) for k, v in vars(a).items()},
              "runs": runs}
    if "cad" in runs and "sdpa" in runs:
        c, s = runs["cad"]["final_loss"], runs["sdpa"]["final_loss"]
        report["final_loss_relative_difference"] = abs(c - s) / abs(s)
        report["speedup"] = runs["sdpa"]["seconds"] / runs["cad"]["seconds"]
        say(f"final loss: cad {c:.6f}, sdpa {s:.6f} (relative difference {report['final_loss_relative_difference']:.2e}); "
            f"training {runs['cad']['seconds']:.1f} s with CAD, {runs['sdpa']['seconds']:.1f} s with sdpa "
            f"(CPU timings of small models are noisy; python/bench/bench_hf_cad.py measures the step)")
    if rank == 0 and a.json is not None:
        with open(a.json, "x") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
