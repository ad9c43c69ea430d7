"""Core attention disaggregation on a process group: plan a step once, then every attention layer
exchanges its rows with the plan's attention servers (distca.torch's StepPlanner and cad_attention).

    planner      StepPlanner: each step's documents gathered over the group, planned in C++, the layout built
    layout       StepLayout: one rank's exchange layout as device tensors (rank_layout builds it from a plan)
    nanobatch    ping-pong's split of one plan's tasks into two nano-batches
    attention    cad_attention: the autograd.Function whose forward and backward are the exchanges
    serve        cad_serve: a rank with no rows this step serves a layer's exchange (an idle pipeline stage)
    agreement    the call header and InputError: every rank raises the same error on any rank's bad input
    buffers      the exchanges' receive buffers, reused across layers and steps
"""
