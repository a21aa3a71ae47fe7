"""Data-parallel engine replicas: `--data-parallel-size N` (or `--num-gpus` beyond the parallel degrees) starts
N executors, each its own rank group on its own devices, all fed by one job queue (`JobManager`).

On GPU replica i uses devices i·world ... (i+1)·world - 1; on CPU each replica has its own rank processes and,
unless --threads says otherwise, each rank takes an equal share of the cores (h3serve.rank.device_checks.cpu_threads).
They start together (the model loads N times in parallel) and share nothing but the queue: a rank that dies fails
only its replica's job."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from h3serve.config.engine_config import EngineConfig
from h3serve.engine.executor import Executor
from h3serve.errors import ConfigError
from h3serve.parallel.rendezvous import Rendezvous


def start_replicas(
    config: EngineConfig, rendezvous: Rendezvous, factory: Callable[..., Executor] = Executor
) -> list[Executor]:
    """Start every replica's executor (in parallel) with `factory` (`Executor`'s signature); `EngineError`
    from the first that fails, after the others are closed. Several nodes run one replica (their ranks meet
    at one rendezvous)."""
    if config.data_parallel_size == 1:
        return [factory(config, rendezvous=rendezvous)]
    if rendezvous.nnodes > 1:
        raise ConfigError("--data-parallel-size with several nodes: run one h3serve serve per node on a shared "
                          "--job-store instead (docs/scaling.md)")
    with ThreadPoolExecutor(config.data_parallel_size) as pool:
        futures = [pool.submit(factory, config, None, Rendezvous.local(), i) for i in range(config.data_parallel_size)]
    started, error = [], None
    for future in futures:
        try:
            started.append(future.result())
        except Exception as e:
            error = error or e
    if error is not None:
        for executor in started:
            executor.close()
        raise error
    return started
