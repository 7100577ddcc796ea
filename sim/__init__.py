"""Everything simulated, apart from the real adapters: the world (machines, GPUs, accounts and
sites in one SQLite file), the provider, the GPUs and the cluster on it, the serving probe's
fault knob, and a model server. ``gpufleet dev`` and the tests run the fleet on these; a real
fleet never imports them (``FleetEnv`` picks them only in sim mode)."""
