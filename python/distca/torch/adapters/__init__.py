"""CAD in the attention slot of training frameworks: `megatron_core` (Megatron Core's
`core_attention` submodule) and `torchtitan` (TorchTitan's attention module). Each imports its
framework only when used; distca.torch itself needs neither."""
