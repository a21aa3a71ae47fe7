"""A deterministic procedural audio-visual demo world (one coloured object, one tone) and checks that measure it."""
