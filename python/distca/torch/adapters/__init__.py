"""CAD in the attention slot of training frameworks: `megatron_core` (Megatron Core's
`core_attention` submodule), `torchtitan` (TorchTitan's attention module) and `transformers`
(Hugging Face's attention interface); `documents` reads packed documents from per-document
positions. Each imports its framework only when used; distca.torch itself needs none."""
