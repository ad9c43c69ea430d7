"""The ranks' side of test_torch_transformers.py: Hugging Face Llama, Qwen3 and Mistral models built
from a config here (no hub download), trained with CAD (distca.torch.adapters.transformers) and
compared with the same model under HF's sdpa run document by document; the refusals; FSDP2.

Every worker runs on ranks started by distca.torch.spawn.run_ranks (gloo, CPU, fp32) and returns
plain numbers and strings.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

STEPS = 3
VOCAB = 97
LR = 3e-3
# AdamW divides each gradient entry by its own size: an entry near zero, where fp32's rounding of
# two correct computations differs in sign, moves its parameter by +-lr either way. With PyTorch's
# eps (1e-8) HF's own packed sdpa and the document-by-document sdpa differ by 7e-4 in a parameter
# after one step (measured); eps 1e-4 keeps those entries' steps proportional to them (1.1e-6;
# eps 1e-5: 3.7e-6, and 7.7e-6 after 3 steps of CAD on 2 ranks, too near the tests' 1e-5).
EPS = 1e-4
# What the planner prices: attention made expensive, so that it moves the long document's rows
# to the other rank even at these sizes (the tests check that rows moved).
PLANNER = {"policy": "minbytes",
           "cost_model": {"layers": 1, "hidden": 4096, "heads": 512, "kv_heads": 64, "head_dim": 512,
                          "ffn_hidden": 4096}}

# Each batch: rank -> its documents' lengths. skewed: one long document on rank 0, many short ones on
# rank 1 (CAD moves rank 0's attention rows to rank 1); every_length: documents of 1 .. 18 tokens.
BATCHES = {
    "skewed": [[160], [13, 40, 7, 50, 1, 49]],
    "every_length": [list(range(1, 19, 2)), list(range(2, 19, 2))],
}


def config(kind: str, **overrides):
    """A small model of the kind: 2 layers, hidden 64, 4 query heads over 2 KV heads (GQA), head_dim 16."""
    from transformers import LlamaConfig, MistralConfig, Qwen3Config
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, head_dim=16)
    common.update(overrides)
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config, "mistral": MistralConfig}[kind]
    return cls(**common)


def models(kind: str, seed: int = 0, **overrides):
    """(reference with HF's sdpa, the same weights for CAD), each with a config of its own."""
    from transformers import AutoModelForCausalLM
    cfg = config(kind, **overrides)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg))
    cad = AutoModelForCausalLM.from_config(copy.deepcopy(cfg))
    cad.load_state_dict(ref.state_dict())
    return ref, cad


def batch(lengths: list, seed: int) -> dict:
    """One packed row of documents, as DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives
    it: input_ids, labels (-100 at each document's first token), position_ids restarting at 0, and
    cu_seq_lens_q/k, max_length_q/k."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=g)
    labels = ids.clone()
    cu = [0]
    for n in lengths:
        labels[0, cu[-1]] = -100
        cu.append(cu[-1] + n)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    return {"input_ids": ids, "labels": labels,
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
            "cu_seq_lens_q": cu_t, "cu_seq_lens_k": cu_t.clone(),
            "max_length_q": max(lengths), "max_length_k": max(lengths), "lengths": lengths}


def model_inputs(b: dict, form: str) -> dict:
    keys = {"cu": ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                   "max_length_k"),
            "positions": ("input_ids", "labels", "position_ids")}[form]
    return {k: b[k] for k in keys}


def reference_loss(ref: nn.Module, b: dict) -> torch.Tensor:
    """HF's sdpa, one document at a time (use_cache=False): the mean next-token loss of the row."""
    total, count, at = 0.0, 0, 0
    for n in b["lengths"]:
        ids = b["input_ids"][:, at:at + n]
        logits = ref(input_ids=ids, use_cache=False).logits
        if n > 1:
            total = total + F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")
            count += n - 1
        else:
            total = total + 0.0 * logits.sum()
        at += n
    return total / max(count, 1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale > 0 else (a - b).abs().max().item()


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.1, foreach=False)


def rows_served_remotely(layout) -> int:
    """Query rows this rank sent to another rank's attention server in the forward's plan."""
    return sum(sum(n for j, n in enumerate(p.q_send_splits) if j != layout.rank) for p in layout.parts)


def _backward_both(model: nn.Module, ref: nn.Module, b: dict, form: str, world: int) -> float:
    """CAD's loss and HF sdpa's document by document, each backpropagated (the reference's gradients
    averaged over the ranks, as DDP averages CAD's) -> their relative difference."""
    loss = model(**model_inputs(b, form)).loss
    loss.backward()
    want = reference_loss(ref, b)
    want.backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    return abs(loss.item() - want.item()) / abs(want.item())


def _step(*optimizers: torch.optim.Optimizer) -> None:
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


def train_worker(rank: int, world: int, cases: list) -> list:
    """cases: (kind, form, checkpointing, batch name) -> per case the worst relative differences of the
    losses, gradients and parameters over STEPS AdamW steps under DDP, and the planner's counts."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from distca.torch.adapters.transformers import apply_cad, cad_state
    out = []
    for kind, form, checkpointing, batch_name in cases:
        ref, model = models(kind)
        ref.train()
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        apply_cad(model, **PLANNER)
        ddp = DDP(model)
        opt, opt_ref = _adamw(model), _adamw(ref)
        worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
        moved = 0
        for step in range(STEPS):
            b = batch(BATCHES[batch_name][rank], seed=1000 * step + rank)
            worst["loss"] = max(worst["loss"], _backward_both(ddp, ref, b, form, world))
            for p, q in zip(model.parameters(), ref.parameters()):
                worst["grad"] = max(worst["grad"], _rel(p.grad, q.grad))
            moved += rows_served_remotely(cad_state(model).layout)
            _step(opt, opt_ref)
        for p, q in zip(model.parameters(), ref.parameters()):
            worst["param"] = max(worst["param"], _rel(p.detach(), q.detach()))
        cad = cad_state(model)
        out.append(dict(worst, case=[kind, form, checkpointing, batch_name], plans=cad.plans, forwards=cad.forwards,
                        calls=cad.calls, layers=model.config.num_hidden_layers, moved=moved))
        cad.finish()
    return out


def _error(fn) -> str:
    from distca.torch import InputError
    try:
        fn()
    except InputError as e:
        return f"InputError: {e}"
    except Exception as e:  # noqa: BLE001 (the test asserts on the kind)
        return f"{type(e).__name__}: {e}"
    return "no error"


REFUSALS = ("padding", "dropout", "window", "window_ok", "rows", "cu_vs_positions", "counts", "eval_one_rank")


def refusals_worker(rank: int, world: int) -> dict:
    """Every kind of REFUSALS in turn, each with a model of its own -> kind: the error this rank got."""
    return {what: refusal_worker(rank, world, what) for what in REFUSALS}


def refusal_worker(rank: int, world: int, what: str) -> str:
    """One kind of bad input, on one rank or on every rank -> the error this rank got."""
    from distca.torch.adapters.transformers import apply_cad, cad_state
    overrides = {"dropout": {"attention_dropout": 0.1}}.get(what, {})
    kind = "mistral" if what in ("window", "window_ok") else "llama"
    if kind == "mistral":
        overrides["sliding_window"] = 32
    ref, model = models(kind, **overrides)
    model.train()
    apply_cad(model)
    lengths = {"window": [[20, 12], [40]], "window_ok": [[20, 12], [32]]}.get(what, [[30], [10, 20]])[rank]
    b = model_inputs(batch(lengths, seed=rank), "cu")

    def run() -> None:
        if what == "padding" and rank == 1:
            b["attention_mask"] = torch.ones_like(b["input_ids"])
            b["attention_mask"][0, -3:] = 0
        if what == "rows" and rank == 0:
            b["cu_seq_lens_q"] = b["cu_seq_lens_k"] = torch.tensor([0, 29], dtype=torch.int32)
        if what == "cu_vs_positions" and rank == 1:
            b["position_ids"] = torch.cat([torch.arange(15), torch.arange(15)])[None]
        if what == "counts":
            model(**b).loss.backward()
            if rank == 0:
                model(**b).loss.backward()    # a forward more than rank 1
            else:
                cad_state(model).finish()
            return
        if what == "eval_one_rank":
            model(**b).loss.backward()
            if rank == 0:
                model.eval()
                with torch.no_grad():
                    model(**b)                # no collective: the other rank is not in it
                model.train()
            model(**b).loss.backward()
            cad_state(model).finish()
            return
        loss = model(**b).loss
        loss.backward()
        if what == "window_ok":
            want = reference_loss(ref, batch(lengths, seed=rank))
            if abs(loss.item() - want.item()) > 1e-5 * abs(want.item()):
                raise AssertionError(f"Mistral within its window: CAD {loss.item()} vs sdpa {want.item()}")
    return _error(run)


def fsdp2_worker(rank: int, world: int) -> dict:
    """FSDP2 (fully_shard per decoder layer and at the root) with CAD attention: 2 AdamW steps equal the
    unsharded sdpa reference, document by document: losses, gradients (gathered) and parameters."""
    from torch.distributed.fsdp import fully_shard
    from distca.torch.adapters.transformers import apply_cad, cad_state
    ref, model = models("llama")
    ref.train()
    model.train()
    apply_cad(model, **PLANNER)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt, opt_ref = _adamw(model), _adamw(ref)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(2):
        b = batch(BATCHES["skewed"][rank], seed=1000 * step + rank)
        worst["loss"] = max(worst["loss"], _backward_both(model, ref, b, "positions", world))
        for p, q in zip(model.parameters(), ref.parameters()):
            worst["grad"] = max(worst["grad"], _rel(p.grad.full_tensor(), q.grad))
        _step(opt, opt_ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        worst["param"] = max(worst["param"], _rel(p.full_tensor().detach(), q.detach()))
    cad = cad_state(model)
    worst.update(plans=cad.plans, forwards=cad.forwards)
    cad.finish()
    return worst


class PlainAttention(nn.Module):
    """Attention computed in the module itself, not through transformers' attention interface (as
    older HF models, and many remote-code ones, do): what apply_cad must refuse, by name."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, hidden_states, *args, **kwargs):
        b, s, h = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, h)), None


def plain_model():
    from transformers import LlamaForCausalLM

    class PlainLlamaForCausalLM(LlamaForCausalLM):
        def __init__(self, cfg):
            super().__init__(cfg)
            for layer in self.model.layers:
                layer.self_attn = PlainAttention(cfg.hidden_size, cfg.num_attention_heads)

    return PlainLlamaForCausalLM(config("llama"))


def one_process_worker(rank: int, world: int, save_dir: str) -> dict:
    """On one rank: forwards outside training (evaluation with HF's default use_cache=True,
    generate()) against HF's sdpa; apply_cad's refusals; save_pretrained."""
    from transformers import AutoModelForCausalLM
    from distca.torch.adapters.transformers import apply_cad, cad_state
    ref, model = models("llama")
    apply_cad(model, **PLANNER)
    lengths = [37, 1, 60, 22]
    b = batch(lengths, seed=5)
    ref.eval()
    model.eval()
    out: dict = {}
    with torch.no_grad():
        got = model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits
        docs, at = [], 0
        for n in lengths:
            docs.append(ref(input_ids=b["input_ids"][:, at:at + n], use_cache=False).logits)
            at += n
        want = torch.cat(docs, dim=1)
        hf_cached = ref(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits   # use_cache=True
        out["eval_vs_documents"] = _rel(got, want)
        out["hf_sdpa_with_cache_vs_documents"] = _rel(hf_cached, want)
        prompt = b["input_ids"][:, :12]
        out["generate_equal"] = bool(torch.equal(model.generate(prompt, max_new_tokens=4, do_sample=False),
                                                 ref.generate(prompt, max_new_tokens=4, do_sample=False)))
    cad = cad_state(model)
    out["counts"] = [cad.forwards, cad.local_forwards, cad.plans]
    model.save_pretrained(save_dir)
    out["saved_implementation"] = AutoModelForCausalLM.from_pretrained(save_dir).config._attn_implementation

    errors = {}
    def refused(name, fn):
        try:
            fn()
            errors[name] = "no error"
        except Exception as e:  # noqa: BLE001 (the test asserts on the kind and words)
            errors[name] = f"{type(e).__name__}: {e}"
    refused("applied_twice", lambda: apply_cad(model))
    refused("not_a_model", lambda: apply_cad(nn.Linear(4, 4)))
    refused("no_interface", lambda: apply_cad(plain_model()))
    from transformers import Gemma2Config, Qwen3Config
    gemma = AutoModelForCausalLM.from_config(Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                                          num_hidden_layers=2, num_attention_heads=4,
                                                          num_key_value_heads=2, head_dim=16))
    refused("softcapping", lambda: apply_cad(gemma))
    mixed = AutoModelForCausalLM.from_config(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                                         num_hidden_layers=2, num_attention_heads=4,
                                                         num_key_value_heads=2, head_dim=16, use_sliding_window=True,
                                                         sliding_window=32, max_window_layers=1))
    refused("mixed_sliding_layers", lambda: apply_cad(mixed))
    _, bidirectional = models("llama")
    bidirectional.model.layers[1].self_attn.is_causal = False
    refused("non_causal", lambda: apply_cad(bidirectional))
    _, other = models("llama")
    refused("bad_planner_option", lambda: apply_cad(other, policy="fastest"))
    out["errors"] = errors
    cad.finish()
    return out
