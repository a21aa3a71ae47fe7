"""Placement of the model's weights: the offload modes (config), the memory planner (plan), and the hooks
that carry a plan out on a device (runtime). No torch in `config` and `plan`: the API process and `h3serve plan`
read them without loading torch."""
