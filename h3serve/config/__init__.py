"""The engine's configuration as frozen values: `EngineConfig` (engine_config.py) and the offload and quantisation
settings it holds (offload_config.py, quantization_config.py). A leaf room that every other room may import;
`h3serve.config_checks` checks a configuration against the checkpoint at start-up."""
