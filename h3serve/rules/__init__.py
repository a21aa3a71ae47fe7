"""The request and its rules, torch-free: the request type, validation into a plan, the canvas and geometry, the
sigma schedules, long-video windows, edit masks, and the limits and names every layer derives from."""
