"""Layouts: meshes and sharding rules, weights placed onto them, and the pipeline stages."""
