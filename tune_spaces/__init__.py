"""Ray Tune search spaces as YAML (dotted keys into kava_ray.common.config.JobConfig)."""
