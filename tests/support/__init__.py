"""Test support, independent of jaxinfer: the shared tiny models' paths and published outputs
(models), checkpoint writers for every family (checkpoints, hybrid_checkpoints), the float64
NumPy reference forwards (reference, reference_hybrid) and a compile counter (compiles)."""
