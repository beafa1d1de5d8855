"""The model: one flax Transformer for every family (config flags pick attention or Gated
DeltaNet, dense MLP or experts), its caches, and the one matmul seam (`linear`)."""
