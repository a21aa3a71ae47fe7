"""The OpenAI-compatible HTTP API (`h3serve serve`): FastAPI routes over the engine's job manager.

Nothing here imports torch or model code: requests become `GenerationRequest`s and jobs in
`h3serve.engine.jobs`, which runs them on the executor's rank processes.
"""
