"""Megatron Core's pipeline under distca's lockstep forward-backward function: the workers of
test_torch_megatron.py's pipeline tests (spawned by run_ranks).

A tiny GPT of 4 layers (megatron_cases.make_config's shape), its weights set from each
parameter's global name (so a stage holding layers 2-3 starts from the same weights as layers 2-3
of the whole model), trained 3 SGD steps on M = 4 packed micro-batches of 96 tokens per replica.
Replica 0 has one micro-batch holding a single 96-token document (a different one each step);
the others hold three short documents. The reference is the whole model on one process with
Megatron's own attention, one document per forward (its local DotProductAttention takes no THD),
over every replica's micro-batches. The loss of a step is the token-summed cross entropy over the
global batch divided by its token count, so micro-batches and replicas add up.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import megatron_cases as mc  # noqa: E402
from distca.torch.adapters import megatron_core as cad_mc  # noqa: E402
from distca.torch.adapters import megatron_lockstep as lockstep  # noqa: E402

LAYERS = 4
MICRO = 4
ROWS = 96
REPLICAS = 2
STEPS = 3
LR = 0.5


def micro_lengths(step: int, replica: int, m: int) -> list:
    if replica == 0 and m == step % MICRO:
        return [ROWS]
    a = 16 + 8 * ((m + replica + step) % 4)
    return [a, 24, ROWS - a - 24]


def micro_documents(step: int, replica: int, m: int) -> list:
    out = []
    for j, n in enumerate(micro_lengths(step, replica, m)):
        g = torch.Generator().manual_seed(((step * 7 + replica) * 11 + m) * 13 + j)
        t = torch.randint(0, mc.VOCAB, (n + 1,), generator=g)
        out.append((t[:-1], t[1:]))
    return out


def global_tokens() -> int:
    return ROWS * MICRO * REPLICAS


def set_weights(model, layer_offset: int) -> None:
    """Every parameter from its global name (decoder.layers.i counted over the whole model)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + layer_offset)
            key = ".".join(parts)
            g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little"))
            x = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * x if p.dim() == 1 else 0.05 * x)


def global_state(model, layer_offset: int) -> dict:
    out = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(int(parts[2]) + layer_offset)
        out[".".join(parts)] = p.detach().clone()
    return out


def build(config, spec, pre: bool, post: bool, offset: int):
    from megatron.core.models.gpt import GPTModel
    model = GPTModel(config, spec, vocab_size=mc.VOCAB, max_sequence_length=2048, position_embedding_type="rope",
                     pre_process=pre, post_process=post, share_embeddings_and_output_weights=False)
    set_weights(model, offset)
    return model


def reference_worker(rank: int, world: int, out_dir: str) -> dict:
    """One process, the whole model, Megatron's attention one document per forward."""
    from megatron.core import parallel_state as ps
    mc.cpu_shims()
    ps.initialize_model_parallel(1, 1)
    model = build(mc.make_config(num_layers=LAYERS), mc.local_spec(), True, True, 0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for replica in range(REPLICAS):
            for m in range(MICRO):
                for t, y in micro_documents(step, replica, m):
                    n = len(t)
                    loss = model(t[None], torch.arange(n)[None], mc.causal_mask(n), labels=y[None]).sum() / global_tokens()
                    loss.backward()
                    total += loss.item()
        opt.step()
        losses.append(total)
    torch.save(global_state(model, 0), os.path.join(out_dir, "pipeline_reference.pt"))
    return {"losses": losses}


def _batch(step: int, replica: int, m: int) -> dict:
    ids, pos, labels, psp = mc.thd_batch(micro_documents(step, replica, m))
    return {"ids": ids, "pos": pos, "labels": labels, "psp": psp}


def forward_step(data_iterator, model):
    """Megatron's forward_step_func: (data_iterator, model) -> (output, loss_func)."""
    b = next(data_iterator)
    out = model(b["ids"], b["pos"], None, labels=b["labels"], packed_seq_params=b["psp"])

    def loss_func(output):
        total = output.sum()
        # Megatron divides the loss by num_microbatches: multiplied back, the step's loss is the
        # global token sum over the global token count.
        return total * MICRO / global_tokens(), {"loss": total.detach() / global_tokens()}

    return out, loss_func


def pipeline_worker(rank: int, world: int, out_dir: str, tp: int = 1) -> dict:
    """PP 2 x DP 2 (x TP tp) on world gloo ranks: the lockstep forward-backward function trains the
    stages 3 SGD steps; returns the losses (last stage), the tick records, and faults' messages."""
    from megatron.core import parallel_state as ps
    mc.cpu_shims()
    ps.initialize_model_parallel(tp, 2)
    stage, replica = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
    assert ps.get_data_parallel_world_size() == REPLICAS
    config = mc.make_config(num_layers=LAYERS, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                            tensor_model_parallel_size=tp)
    cad = cad_mc.CADContext(config, group=lockstep.lockstep_group(), backward="stateless", pingpong=False)
    per_stage = LAYERS // 2
    model = build(config, cad_mc.use_cad(mc.local_spec(), cad), stage == 0, stage == 1, stage * per_stage)
    fb = lockstep.LockstepForwardBackward(cad)
    dp_group = ps.get_data_parallel_group()
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def run(step: int, forward_only: bool = False, num_microbatches: int = MICRO) -> float:
        data = iter([_batch(step, replica, m) for m in range(MICRO)])
        store = fb(forward_step_func=forward_step, data_iterator=data, model=[model],
                   num_microbatches=num_microbatches, seq_length=ROWS, micro_batch_size=1, forward_only=forward_only)
        total = torch.tensor(float(sum(d["loss"] for d in store)) if store else 0.0, dtype=torch.float64)
        dist.all_reduce(total, group=dp_group)
        return total.item()

    result: dict = {"stage": stage, "replica": replica, "tp_rank": ps.get_tensor_model_parallel_rank()}
    result["forward_only"] = run(0, forward_only=True)
    losses, records = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=False)
        losses.append(run(step))
        for p in model.parameters():
            dist.all_reduce(p.grad, group=dp_group)
        opt.step()
        records.append([r.to_dict() for r in fb.records])
    result["losses"] = losses
    result["records"] = records
    result["num_plans"] = cad.num_plans
    if replica == 0:
        torch.save(global_state(model, stage * per_stage),
                   os.path.join(out_dir, f"pipeline_stage{stage}_tp{result['tp_rank']}.pt"))
    # A rank with another micro-batch count: the same error on every rank, nothing hangs.
    try:
        run(0, num_microbatches=MICRO - 1 if rank == world - 1 else MICRO)
        result["mismatch"] = None
    except Exception as e:  # noqa: BLE001 (the message is the result)
        result["mismatch"] = f"{type(e).__name__}: {e}"
    cad.planner.close()
    return result
