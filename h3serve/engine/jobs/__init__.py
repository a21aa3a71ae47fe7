"""The queue side of the engine: video jobs in a durable, store-driven queue, run by one runner per engine
replica (`JobManager`, manager.py). No torch, no HTTP."""

from h3serve.engine.jobs.manager import JobManager

__all__ = ["JobManager"]
