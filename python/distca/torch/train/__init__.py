"""The distca.torch trainer, `python -m distca.torch.train` (__main__): a Llama-style model trained
data-parallel with CAD or colocated attention, the PyTorch counterpart of `distca train`; docs/torch.md.

    trainer      the training itself: each backend's model, optimizer and planner, the step loop, main
    config       the command line: flags, Config, the checks that need no collective, the ranks' agreement
    data         the steps' documents: synthetic workloads or a JSON lines file, each rank's slice
    model        the model: plain nn.Module code with its core attention passed in
    report       each step's record gathered from every rank, the per-step line, the summary, the JSON
    checkpoint   the checkpoint format: a folder of JSON and raw bytes, nothing unpickled
    resume       what a save holds, rank 0's save, and the checks on --resume
    watch        the heartbeat that names the rank a failed collective waited for
"""
