"""The Pallas kernels, written for the GPU's Triton lowering and run anywhere in Pallas's
interpreter (`interpret=True`, how the CPU tests run them): paged attention (`attention`),
quantized products that dequantize in their tiles (`quantized`), the Gated DeltaNet step and
chunk (`delta`) and the expert block's grouped product (`grouped`). kernels/__init__ is the
only seam the model reaches them through."""
