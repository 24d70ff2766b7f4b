"""h3gen's video decoder: the ViT decoder's fused blocks and its tiling."""
