"""The Ray actors: the teachers (HF and vLLM), their pool (names, placement, restarts, replicas) and
the KV cache's writer. Their student-side clients (the feed, the step sources, the sampling engines)
are `kava_ray.rollout`."""
