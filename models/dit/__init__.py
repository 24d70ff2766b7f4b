"""h3gen's DiT: MiniMax-H3's transformer with fused kernels, AdaLN tables and packed weights."""
