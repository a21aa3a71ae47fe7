"""Everything that runs inside a rank process (torch): the worker loop, the local engine, checkpoint loading,
conditioning and memory sampling. The parent side (api/, engine/, jobstore/) never imports this package."""
