"""The roof: the `gpufleet` command, the dev stack and game days."""
