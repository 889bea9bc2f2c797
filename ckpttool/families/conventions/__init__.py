"""Source conventions: how a training framework names, fuses and stacks a model's tensors (Megatron-Core in both
directions and its DeepSeek-style MLA tensors, DeepSpeed MoE), mapped to and from HuggingFace names."""
