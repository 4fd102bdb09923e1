"""Job presets shipped as package data (load them by name with kava_ray.config.load_config)."""
