"""Placement of the model's weights: the memory planner (planner.py and what it counts) and the hooks that carry a
plan out on a device (runtime.py). The offload flags are `h3serve.config.offload_config`. No torch in the planner:
the API process and `h3serve plan` read it without loading torch."""
