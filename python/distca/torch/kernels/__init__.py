"""Server kernels: attention over one server's task list, behind one small interface.

    server       the interface (ServerKernel) and what every kernel shares: ServerTasks, the GQA helpers
    pytorch      the kernels on PyTorch's operators: reference, sdpa, varlen, flash_attn, flex
    native       the kernels of distca's native code, through its custom operators: distca, hopper, cudnn
    ops          those operators, torch.ops.distca.attention_fwd/_bwd (registered on import)
    backends     the kernels by name, and `auto`'s choice (get_backend, backend_names)

The measured table `auto` reads on CUDA is distca.torch.kernel_table.
"""
