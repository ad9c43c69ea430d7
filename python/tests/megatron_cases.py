"""Megatron Core with CAD core attention against Megatron's own attention: the workers of
test_torch_megatron.py (spawned by run_ranks, so they live in an importable module) and the GPU
check (`python python/tests/megatron_cases.py --device cuda`, see main()).

A tiny GPT (2 layers, hidden 64, 4 heads / 2 query groups, RMSNorm, SwiGLU, RoPE, fp32), built
from Megatron's local layer spec twice with the same seed: once with Megatron's
DotProductAttention, once with distca's CADCoreAttention (use_cad). Both train a few SGD steps on
the same documents: Megatron's attention one document per forward (sbhd, batch 1, causal mask:
its local DotProductAttention takes no packed THD input), CAD all of a rank's documents packed in
one THD forward (PackedSeqParams). The loss of a step is the token-summed cross entropy over the
global batch divided by its token count, so per-rank losses and gradients add up (the test
all-reduces the gradients itself: it is data parallelism without Megatron's DDP wrapper).

CPU shims (applied only when CUDA is unavailable; Megatron Core assumes a GPU in two places on
this path): `torch.cuda.current_device()` returns "cpu" (Megatron's RoPE module moves its
frequencies to the current CUDA device at the first forward, and DotProductAttention takes its
score buffer from parallel_state's global memory buffer on that device), and
`CudaRNGStatesTracker.fork` is a no-op context (DotProductAttention forks the CUDA RNG around its
attention dropout, here p = 0, and the tracker's states can only be made with CUDA). Neither
changes any value computed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distca.torch.adapters import megatron_core as cad_mc  # noqa: E402

VOCAB = 128
NUM_LAYERS = 2
STEPS = 3
LR = 0.5
SEED = 1234


# Setup -----------------------------------------------------------------------------------------

def cpu_shims() -> None:
    """The two CPU shims (module docstring), applied only when there is no GPU."""
    from megatron.core.tensor_parallel import random as mrandom
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
        mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def setup(device: str = "cpu") -> None:
    """Megatron's model-parallel state over the current world (TP = PP = CP = 1: DP = world), and
    the CPU shims (module docstring) when there is no GPU."""
    from megatron.core import parallel_state as ps
    if device == "cpu":
        cpu_shims()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)


def make_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig
    kw = dict(num_layers=NUM_LAYERS, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
              kv_channels=16, use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
              normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
              params_dtype=torch.float32, init_method_std=0.05, masked_softmax_fusion=False,
              bias_dropout_fusion=False, apply_rope_fusion=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def make_model(config, spec, device: str = "cpu"):
    """The same weights for the same config, whatever the core attention."""
    from megatron.core.models.gpt import GPTModel
    torch.manual_seed(SEED)
    if str(device).startswith("cuda"):
        from megatron.core.tensor_parallel import random as mrandom
        mrandom.model_parallel_cuda_manual_seed(SEED)    # GPU initialisation draws from Megatron's tracker
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=2048, position_embedding_type="rope")
    return model.to(device)


def local_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    return get_gpt_layer_local_spec(normalization="RMSNorm")


def cad_layers(model) -> list:
    return [m for m in model.modules() if type(m).__name__ == "CADCoreAttention"]


# Data ------------------------------------------------------------------------------------------

def rank_lengths(step: int, world: int) -> list:
    """Each rank's document lengths at a step: rank 0 holds a long document (its attention costs
    several times rank 1's), so CAD moves attention work from rank 0 to rank 1."""
    lengths = [[224 + 16 * step, 32], [40 + 8 * step, 64, 24, 48]]
    if world == 1:
        return [lengths[0] + lengths[1]]
    assert world == 2
    return lengths


def documents(step: int, lengths: list) -> list:
    """(tokens, labels) per document: next-token prediction inside the document."""
    out = []
    for j, n in enumerate(lengths):
        g = torch.Generator().manual_seed(1000 * step + 17 * j + n)
        t = torch.randint(0, VOCAB, (n + 1,), generator=g)
        out.append((t[:-1], t[1:]))
    return out


def step_documents(step: int, rank: int, world: int) -> list:
    """This rank's documents: the same global documents, split by rank, whatever the world."""
    flat = [n for r in rank_lengths(step, 2) for n in r]
    docs = documents(step, flat)
    if world == 1:
        return docs
    start = sum(len(r) for r in rank_lengths(step, 2)[:rank])
    return docs[start:start + len(rank_lengths(step, 2)[rank])]


def global_tokens(step: int) -> int:
    return sum(n for r in rank_lengths(step, 2) for n in r)


def thd_batch(docs: list, device: str = "cpu"):
    from megatron.core.packed_seq_params import PackedSeqParams
    lengths = [len(t) for t, _ in docs]
    ids = torch.cat([t for t, _ in docs])[None].to(device)
    labels = torch.cat([y for _, y in docs])[None].to(device)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                          max_seqlen_kv=max(lengths))
    return ids, pos, labels, psp


def causal_mask(n: int, device: str = "cpu") -> torch.Tensor:
    return torch.triu(torch.ones(1, 1, n, n, dtype=torch.bool, device=device), 1)   # True: masked out


# Training --------------------------------------------------------------------------------------

def train(model, mode: str, rank: int, world: int, group=None, device: str = "cpu", steps: int = STEPS) -> dict:
    """SGD steps. mode "thd": this rank's documents in one packed forward (CAD); "per_doc": one sbhd
    forward per document (Megatron's attention); "sbhd": the documents cut to one length, one
    [S, B] forward (either attention). Gradients and losses are summed over `group`."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    initial = [p.detach().clone() for p in model.parameters()]
    losses, seconds = [], []
    for step in range(steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        docs = step_documents(step, rank, world)
        n_global = global_tokens(step)
        total = torch.zeros((), dtype=torch.float64, device=device)
        if mode == "thd":
            ids, pos, labels, psp = thd_batch(docs, device)
            loss = model(ids, pos, None, labels=labels, packed_seq_params=psp).sum() / n_global
            loss.backward()
            total += loss.detach().double()
        elif mode == "per_doc":
            for t, y in docs:
                n = len(t)
                loss = model(t[None].to(device), torch.arange(n, device=device)[None], causal_mask(n, device),
                             labels=y[None].to(device)).sum() / n_global
                loss.backward()
                total += loss.detach().double()
        elif mode == "sbhd":
            s = 24
            ids = torch.stack([t[:s] for t, _ in docs]).to(device)            # [B, S]
            labels = torch.stack([y[:s] for _, y in docs]).to(device)
            pos = torch.arange(s, device=device).expand_as(ids)
            loss = model(ids, pos, causal_mask(s, device), labels=labels).sum() / n_global
            loss.backward()
            total += loss.detach().double()
        else:
            raise ValueError(mode)
        if group is not None and dist.get_world_size(group) > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
            dist.all_reduce(total, group=group)
        opt.step()
        losses.append(total.item())
        seconds.append(time.perf_counter() - start)
    change = max(rel(p.detach(), p0) if p0.abs().max() > 0 else 0.0
                 for p, p0 in zip(model.parameters(), initial))
    return {"losses": losses, "seconds": seconds, "param_change": change}


def save_params(model, path: str) -> None:
    torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items() if v is not None
                and isinstance(v, torch.Tensor)}, path)


def new_cad(config, group, policy: str = "distca", **kw):
    """The paper's planner ("distca") splits rank 0's long document between the ranks (key-split
    tasks) at these sizes; minbytes / minmax move whole small documents at most."""
    if policy in ("minbytes", "minmax"):
        kw.setdefault("granularity", 16)
    return cad_mc.CADContext(config, group=group, policy=policy, pingpong=False, **kw)


# Workers ---------------------------------------------------------------------------------------

def gpt_worker(rank: int, world: int, out_dir: str, device: str = "cpu") -> dict:
    """world 1: Megatron's attention (per document) and CAD (THD; and sbhd, against Megatron's
    sbhd) on the whole global batch. world 2: CAD, each rank its own documents."""
    setup(device)
    group = dist.group.WORLD
    result: dict = {}
    config = make_config()
    if world == 1:
        ref = make_model(config, local_spec(), device)
        result["ref_per_doc"] = train(ref, "per_doc", rank, world, group, device)
        save_params(ref, os.path.join(out_dir, "ref_per_doc.pt"))
        ref = make_model(config, local_spec(), device)
        result["ref_sbhd"] = train(ref, "sbhd", rank, world, group, device)
        save_params(ref, os.path.join(out_dir, "ref_sbhd.pt"))
        cad = new_cad(config, group)
        model = make_model(config, cad_mc.use_cad(local_spec(), cad), device)
        result["cad_sbhd"] = train(model, "sbhd", rank, world, group, device)
        result["cad_sbhd"]["num_plans"] = cad.num_plans
        save_params(model, os.path.join(out_dir, "cad_sbhd_w1.pt"))
    cad = new_cad(config, group)
    model = make_model(config, cad_mc.use_cad(local_spec(), cad), device)
    layers = cad_layers(model)
    r = train(model, "thd", rank, world, group, device)
    r["num_plans"] = cad.num_plans
    r["num_layers"] = len(layers)
    r["layer_calls"] = [m.num_calls for m in layers]
    layout = cad.layout
    sent = [sum(p.q_send_splits) - p.q_send_splits[rank] for p in layout.parts]
    r["last_step"] = {"rows": layout.num_local_rows, "q_rows_sent_away": sum(sent), "plan_hash": f"{layout.hash:016x}",
                      "server_pairs": [int(x) for x in layout.plan.server_pairs],
                      "tasks": [list(map(int, t)) for t in layout.plan.tasks.tolist()]}
    result["cad_thd"] = r
    if rank == 0:
        save_params(model, os.path.join(out_dir, f"cad_thd_w{world}.pt"))
    return result


def world1_worker(rank: int, world: int, out_dir: str) -> dict:
    """Everything that runs on one rank, in one process (one spawn)."""
    return {"gpt": gpt_worker(rank, world, out_dir), "layer": layer_worker(rank, world)}


def layer_worker(rank: int, world: int) -> dict:
    """CADCoreAttention alone (world 1): THD against distca's per-document reference and Megatron's
    DotProductAttention run per document on the same q/k/v (values and gradients); sbhd against
    DotProductAttention on [S, B]; the explicit-planning mode; and the errors."""
    setup()
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from distca.torch.train.model import document_attention
    config = make_config()
    cad = new_cad(config, dist.group.WORLD)
    CAD = cad_mc.CADCoreAttention
    kw = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    layer = CAD(config, cad=cad, **kw)
    mega = DotProductAttention(config, **kw)
    hq, hkv, d = 4, 2, 16
    lengths = [70, 5, 130, 1, 33]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    g = torch.Generator().manual_seed(7)
    t = sum(lengths)
    q0, k0, v0, do = (torch.randn(t, h, d, generator=g, dtype=torch.float32) for h in (hq, hkv, hkv, hq))
    out: dict = {}

    def run(fn):
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        o = fn(q, k, v)
        o.backward(do.reshape(o.shape))
        return [o.detach().reshape(t, hq, d), q.grad, k.grad, v.grad]

    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                          max_seqlen_kv=max(lengths))
    got = run(lambda q, k, v: layer(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=psp))
    out["thd_out_shape"] = list(layer(q0, k0, v0, None, packed_seq_params=psp).shape)
    ref = run(document_attention(cu.long()))

    def megatron_per_doc(q, k, v):
        bounds = cu.tolist()
        parts = [mega(q[a:b, None], k[a:b, None], v[a:b, None], causal_mask(b - a)) for a, b in zip(bounds, bounds[1:])]
        return torch.cat(parts)[:, 0]                                            # [T, Hq * D]
    meg = run(megatron_per_doc)
    out["thd_vs_reference"] = [rel(a, b) for a, b in zip(got, ref)]
    out["thd_vs_megatron"] = [rel(a, b) for a, b in zip(got, meg)]
    out["thd_num_plans"] = cad.num_plans                                        # 3 calls, one cu tensor
    # sbhd [S, B, H, D]: B documents of length S.
    s, b = 48, 3
    qs, ks, vs, dos = (x[:s * b].reshape(b, s, -1, d).transpose(0, 1).contiguous() for x in (q0, k0, v0, do))

    def run_sbhd(fn):
        q, k, v = (x.clone().requires_grad_() for x in (qs, ks, vs))
        o = fn(q, k, v)
        o.backward(dos.reshape(o.shape))
        return [o.detach(), q.grad, k.grad, v.grad]
    got = run_sbhd(lambda q, k, v: layer(q, k, v, causal_mask(s)))
    meg = run_sbhd(lambda q, k, v: mega(q, k, v, causal_mask(s)))
    out["sbhd_out_shape"] = list(got[0].shape)
    out["sbhd_vs_megatron"] = [rel(a, b) for a, b in zip(got, meg)]
    # Explicit planning: the layer uses the caller's layout and plans nothing.
    manual = new_cad(config, dist.group.WORLD, auto_plan=False)
    layer2 = CAD(config, cad=manual, **kw)
    out["explicit_error"] = _error(lambda: layer2(q0, k0, v0, None, packed_seq_params=psp))
    manual.plan(cu)
    got = run(lambda q, k, v: layer2(q, k, v, None, packed_seq_params=psp))
    out["explicit_vs_reference"] = [rel(a, b) for a, b in zip(got, ref)]
    out["explicit_num_plans"] = manual.num_plans
    # Specs: use_cad copies (the given spec keeps Megatron's attention), cad_layer_spec.
    spec = local_spec()
    new = cad_mc.use_cad(spec, cad)
    out["use_cad_copies"] = (spec.submodules.self_attention.submodules.core_attention is DotProductAttention
                             and new.submodules.self_attention.submodules.core_attention.module is CAD)
    built = cad_mc.cad_layer_spec(cad, normalization="RMSNorm").submodules.self_attention.submodules.core_attention
    out["cad_layer_spec"] = built.module is CAD and built.params["cad"] is cad
    # Tensor parallelism: each rank's layer holds heads / tp (the context is told tp; the layer reads
    # it from its pg_collection, here a stand-in whose tp group has 2 ranks).
    from types import SimpleNamespace
    tp2 = new_cad(config, dist.group.WORLD, tp_size=2)
    m2 = tp2.planner.model
    fake_tp = SimpleNamespace(tp=SimpleNamespace(size=lambda: 2))
    layer_tp = CAD(config, cad=tp2, pg_collection=fake_tp, **kw)
    out["tp2_shape"] = [m2.num_q_heads, m2.num_kv_heads, m2.head_dim, layer_tp.num_attention_heads_per_partition,
                        layer_tp.num_query_groups_per_partition]
    out["tp2_mismatch"] = _error(lambda: CAD(config, cad=cad, pg_collection=fake_tp, **kw))
    out["errors"] = error_cases(config, cad, layer, psp, q0, k0, v0)
    return out


def error_cases(config, cad, layer, psp, q, k, v) -> dict:
    from dataclasses import replace
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    CAD = cad_mc.CADCoreAttention
    kw = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    e = {}
    e["no_context"] = _error(lambda: CAD(config, **kw))
    e["dropout_config"] = _error(lambda: CAD(make_config(attention_dropout=0.1), cad=cad, **kw))
    e["dropout_arg"] = _error(lambda: CAD(config, cad=cad, attention_dropout=0.2, **kw))
    cp = replace(config)
    cp.context_parallel_size = 2
    e["context_parallel"] = _error(lambda: CAD(cp, cad=cad, **kw))
    e["context_parallel_ctx"] = _error(lambda: cad_mc.CADContext(cp))
    e["no_mask"] = _error(lambda: CAD(config, cad=cad, **{**kw, "attn_mask_type": AttnMaskType.no_mask}))
    e["padding_mask"] = _error(lambda: CAD(config, cad=cad, **{**kw, "attn_mask_type": AttnMaskType.padding}))
    e["cross_attention"] = _error(lambda: CAD(config, cad=cad, **{**kw, "attention_type": "cross"}))
    e["window"] = _error(lambda: CAD(make_config(window_size=(64, 0)), cad=cad, **kw))
    e["shape_mismatch"] = _error(lambda: CAD(make_config(num_query_groups=4), cad=cad, **kw))
    e["thd_no_cu"] = _error(lambda: layer(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd")))
    other = psp.cu_seqlens_q.clone()
    other[1] += 1
    e["thd_kv_differs"] = _error(lambda: layer(q, k, v, None, packed_seq_params=replace(psp, cu_seqlens_kv=other)))
    e["thd_rows"] = _error(lambda: layer(q[:-3], k[:-3], v[:-3], None, packed_seq_params=replace(
        psp, cu_seqlens_q=psp.cu_seqlens_q.clone(), cu_seqlens_kv=None)))
    e["bias"] = _error(lambda: layer(q, k, v, None, attention_bias=torch.zeros(1), packed_seq_params=psp))
    e["bshd"] = _error(lambda: layer(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="bshd")))
    e["forward_mask_type"] = _error(lambda: layer(q, k, v, None, attn_mask_type=AttnMaskType.no_mask,
                                                  packed_seq_params=psp))
    e["sbhd_padding_causal"] = _error(lambda: layer(q[:, None], k[:, None], v[:, None], None,
                                                    attn_mask_type=AttnMaskType.padding_causal))
    e["use_cad_no_slot"] = _error(lambda: cad_mc.use_cad(cad_mc.require_megatron().ModuleSpec(module=torch.nn.Identity), cad))
    return e


def _error(fn) -> str:
    try:
        fn()
    except Exception as ex:  # noqa: BLE001 (the test checks the type and the message)
        return f"{type(ex).__name__}: {ex}"
    return "no error"


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item() / max(want.double().abs().max().item(), 1e-30)


# The GPU check ---------------------------------------------------------------------------------

def main() -> int:
    """The GPU check, without the CPU shims (exit 1 when a check fails):

        python python/tests/megatron_cases.py --device cuda --json build/megatron-w1.json
        torchrun --nproc-per-node 2 python/tests/megatron_cases.py --device cuda \
            --compare build/megatron-w1.json --json build/megatron-w2.json     # two GPUs

    The first (one GPU, a 1-rank NCCL group) runs gpt_worker's 1-rank comparisons (CAD THD and
    sbhd against Megatron's DotProductAttention, fp32) and, with Transformer Engine installed, CAD
    against TEDotProductAttention on the same packed THD batches (bf16). The second runs the
    2-rank CAD training and checks it against the first's results. `--device cpu` runs the same on
    CPU (gloo)."""
    parser = argparse.ArgumentParser(description="Megatron Core with CAD against Megatron's attention")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--compare", default=None, help="a 1-rank report to check a 2-rank run against")
    parser.add_argument("--out", default="build/megatron-check", help="folder for the trained weights")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    backend = "nccl" if args.device == "cuda" else "gloo"
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"file://{out.resolve()}/store-{time.time_ns()}", rank=0,
                                world_size=1)
    device = f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else "cpu"
    report: dict = {"world": world, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    mine = gpt_worker(rank, world, str(out), device)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    if world == 1:
        report["w1"] = gathered[0]
        report["checks"] = check_gpt(gathered[0], None)
        te = te_comparison(device) if args.device == "cuda" else None
        if te is not None:
            report["te"] = te
            report["checks"]["te_losses"] = "error" not in te and max(te["rel_loss"]) < 2e-2
    else:
        report["w2"] = gathered
        if args.compare:
            report["checks"] = check_gpt(json.loads(Path(args.compare).read_text())["w1"], gathered)
        report["checks"] = {**report.get("checks", {}),
                            "w2_moved_rows": gathered[0]["cad_thd"]["last_step"]["q_rows_sent_away"] > 0}
    ok = all(report["checks"].values())
    if rank == 0:
        print(json.dumps(report, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        print("megatron check:", "pass" if ok else "FAIL", report["checks"])
    dist.destroy_process_group()
    return 0 if ok else 1


def check_gpt(w1: dict, w2, tol: float = 1e-5) -> dict:
    """The GPU check's pass/fail (what test_torch_megatron asserts on CPU)."""
    def loss_rel(a, b):
        return max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"]))
    if w2 is not None:
        return {"w2_vs_w1": loss_rel(w2[0]["cad_thd"], w1["cad_thd"]) < tol,
                "w2_vs_megatron": loss_rel(w2[0]["cad_thd"], w1["ref_per_doc"]) < tol}
    return {"thd_vs_megatron": loss_rel(w1["cad_thd"], w1["ref_per_doc"]) < tol,
            "sbhd_vs_megatron": loss_rel(w1["cad_sbhd"], w1["ref_sbhd"]) < tol,
            "plans_once_per_step": w1["cad_thd"]["num_plans"] == STEPS}


def te_comparison(device: str):
    """CAD against Transformer Engine's THD attention in the same bf16 GPT (None without TE)."""
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    except ImportError:
        return None
    try:
        config = make_config(use_cpu_initialization=False, bf16=True, params_dtype=torch.bfloat16)
        te_model = make_model(config, get_gpt_layer_with_transformer_engine_spec(), device)
        ref = train(te_model, "thd", 0, 1, None, device)
        cad = new_cad(config, dist.group.WORLD)
        model = make_model(config, cad_mc.use_cad(get_gpt_layer_with_transformer_engine_spec(), cad), device)
        got = train(model, "thd", 0, 1, None, device)
    except Exception as e:  # noqa: BLE001 (reported as a failed check)
        return {"error": f"{type(e).__name__}: {e}"}
    return {"te_losses": ref["losses"], "cad_losses": got["losses"],
            "rel_loss": [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]}


if __name__ == "__main__":
    sys.exit(main())


def tp_worker(rank: int, world: int) -> dict:
    """TP 2 x DP world / 2 on CPU: Megatron's own attention (per document) and CAD (THD, over the
    data-parallel group of this rank's TP index: the CAD group), both with Megatron's
    tensor-parallel layers (heads, FFN and vocabulary split over the TP group), 3 SGD steps from
    the same weights. Returns both runs' losses, the largest relative difference of this rank's
    parameter shards after training, and the CAD planner's attention shape."""
    from megatron.core import parallel_state as ps
    cpu_shims()
    ps.initialize_model_parallel(2, 1)
    dp_group, replica, replicas = ps.get_data_parallel_group(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    config = make_config(tensor_model_parallel_size=2)
    ref = make_model(config, local_spec())
    r_ref = train(ref, "per_doc", replica, replicas, dp_group)
    cad = new_cad(config, dp_group)
    model = make_model(config, cad_mc.use_cad(local_spec(), cad))
    r_cad = train(model, "thd", replica, replicas, dp_group)
    worst = max(rel(a.detach(), b.detach()) for a, b in zip(model.parameters(), ref.parameters()))
    m = cad.planner.model
    out = {"ref": r_ref["losses"], "cad": r_cad["losses"], "param_rel": worst, "num_plans": cad.num_plans,
           "shape": [m.num_q_heads, m.num_kv_heads, m.head_dim], "tp_rank": ps.get_tensor_model_parallel_rank(),
           "moved": sum(sum(p.q_send_splits) - p.q_send_splits[dist.get_rank(dp_group)] for p in cad.layout.parts)}
    cad.planner.close()
    return out
