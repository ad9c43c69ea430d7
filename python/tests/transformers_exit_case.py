"""Run under torchrun by test_torch_transformers.py: a script that trains a small HF Llama with CAD and
ends without calling finish() or destroying the process group, as many scripts do.

    transformers_exit_case.py FORWARDS_RANK0 FORWARDS_RANK1

Equal counts: both ranks exit 0 (the adapter's atexit handler agrees on the counts and lets the
groups go). Rank 1 running fewer forwards (a last short batch): rank 1 exits first, its atexit
handler meets rank 0 in its next forward, and both print the one line and exit 1.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import transformers_cases as cases  # noqa: E402
from distca.torch.adapters.transformers import apply_cad  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
_, model = cases.models("llama")
model.train()
apply_cad(model)
for step in range(int(sys.argv[1 + rank])):
    b = cases.model_inputs(cases.batch([[30], [10, 20]][rank], seed=step), "cu")
    try:
        model(**b).loss.backward()
    except ValueError as e:   # InputError: the one line, status 1
        sys.stderr.write(f"rank {rank}: {e}\n")   # one write: the ranks share the stream
        sys.stderr.flush()
        sys.exit(1)
print(f"rank {rank}: done", flush=True)
