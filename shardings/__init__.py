"""The built-in layouts, one TOML file each (read by jaxinfer.sharding.load_layout)."""

BUILTIN = ("single", "layer", "tensor", "layer-tensor", "expert", "layer-expert")
