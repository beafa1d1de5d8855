"""Ops: the math the model is made of, in plain jax.numpy: quantized weight formats and their
dequantization, sampling, norms. No backend choice here (that is `kernels/`)."""
