"""Job presets shipped as package data (load them by name with kava_ray.common.config.load_config)."""
