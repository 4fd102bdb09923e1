"""Ray actors built on the kava_ray leaf modules: teacher pool and the student-side KV feed."""
