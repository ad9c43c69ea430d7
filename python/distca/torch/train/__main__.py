"""`python -m distca.torch.train` (torchrun's `-m distca.torch.train` too): the trainer's command
line (trainer.main), and how its process ends."""
from __future__ import annotations

import os
import sys

import torch.distributed as dist

from .trainer import main

if __name__ == "__main__":
    status = main()
    if status == 130 or dist.is_initialized():
        # Interrupted, or a collective failed (the group is left as it is: tearing it down could
        # wait on a peer forever, and a live gloo group at the interpreter's teardown can abort
        # it): leave at once; the checkpoint on disk is whole.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
