"""How a run is configured: the typed schema, recipes and flags read into it, the run plan, defaults, the hub."""
