"""torch.compile of the DiT: each block (regional, the default) or the whole forward (full).

Regional compilation replaces each block's `forward` (a DiT block's `modulated` body: its AdaLN lookup stays
eager), not the module call, so forward pre/post hooks (offload streaming, bench counters) keep running eagerly
around the graph. Identical blocks share one graph: their
parameters are graph inputs (Dynamo inlines built-in nn modules). Collectives and the sequence-parallel
attention core are `torch.compiler.disable` islands (h3serve.parallel.comm / sequence), so a compiled block
graph-breaks there instead of tracing process-group calls.

Compilation is lazy (the first forward of each shape): a failure there falls back to eager for every compiled
module, with one warning line, and the step is recomputed eagerly, but only when the failed call issued no
collective: the graph after a graph break compiles once the collective before it ran, and re-running the whole
call eagerly would issue that collective twice on this rank, out of step with the others. Such a failure fails
the job instead (the executor then restarts the ranks, which compile nothing in flight).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from h3serve.errors import ServerError

GRANULARITIES = ("regional", "full")
Backend = str | Callable[..., Any]  # a torch.compile backend: "inductor" in service, others in tests


class CollectiveCount:
    """Collectives this process has issued; h3serve.parallel's helpers count each one as they issue it."""

    issued: int = 0


COLLECTIVES = CollectiveCount()


def count_collective() -> None:
    """Called by every collective helper (eager, outside any graph) as it issues a collective."""
    COLLECTIVES.issued += 1


class CompileFailedMidCall(ServerError, RuntimeError):
    """A compiled call failed after it had issued a collective: it cannot be re-run eagerly (see module doc)."""


@dataclass
class CompileState:
    """Shared by every module compiled for one engine: one failure switches them all back to eager."""

    log: Callable[[str], None]
    failed: bool = False
    restore: list[Callable[[], None]] = field(default_factory=list)

    def fall_back(self, error: BaseException) -> None:
        if self.failed:
            return
        self.failed = True
        for undo in self.restore:
            undo()
        root = error
        # Dynamo wraps the backend's own error (BackendCompilerFailed.inner_exception): name that one.
        while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
            root = inner
        first_line = (str(root).strip().splitlines() or [""])[0][:200]
        self.log(f"warning: torch.compile failed ({type(root).__name__}: {first_line}); running the DiT eagerly")


def _guarded(
    module: nn.Module, compiled: Callable[..., Any], eager: Callable[..., Any], state: CompileState, name: str
):
    def forward(*args: Any, **kwargs: Any) -> Any:
        if state.failed:
            return eager(*args, **kwargs)
        issued = COLLECTIVES.issued
        try:
            return compiled(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # compile errors surface on a shape's first call, under many exception types
            state.fall_back(e)
            if COLLECTIVES.issued != issued:  # the other ranks are past them: an eager re-run would not pair up
                raise CompileFailedMidCall(
                    f"torch.compile failed after {name} of {type(module).__name__} had issued "
                    f"{COLLECTIVES.issued - issued} collective(s); the request fails rather than re-run them"
                ) from e
            return eager(*args, **kwargs)

    setattr(module, name, forward)
    state.restore.append(lambda: setattr(module, name, eager))


def _compile_forward(module: nn.Module, dynamic: bool, state: CompileState, backend: Backend) -> None:
    """Compile the module's declared `compiled_region` method (a block's body without its AdaLN lookup), else
    its `forward`."""
    name = getattr(type(module), "compiled_region", "forward")
    eager = getattr(module, name)
    _guarded(module, torch.compile(eager, dynamic=dynamic, backend=backend), eager, state, name)


def blocks_of(transformer: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the main DiT blocks and the token refiner's."""
    return [*transformer.transformer_blocks, *transformer.token_refiner.refiner_blocks]


def compile_transformer(
    transformer: nn.Module, granularity: str, dynamic: bool, state: CompileState, backend: Backend = "inductor"
) -> None:
    """Compile `transformer` (an H3Transformer) in place; eager on the first failure (see module doc)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"compile granularity {granularity!r}: choose from: {', '.join(GRANULARITIES)}")
    if granularity == "full":
        _compile_forward(transformer, dynamic, state, backend)
        return
    for block in blocks_of(transformer):
        _compile_forward(block, dynamic, state, backend)
