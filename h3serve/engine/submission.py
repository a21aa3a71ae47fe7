"""From a request to a job record: planning, admission and the record, owned by the engine.

The API process only parses the request and answers; what a request becomes (its plan, whether its cost is
admitted, the job that is queued) is decided here, the same for every route that makes a job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from h3serve.engine.admission import check_cost, default_max_cost
from h3serve.engine.planning import plan_request
from h3serve.jobstore.records import Job
from h3serve.request import GenerationRequest
from h3serve.validate import GenerationPlan, ModelDefaults


class Planner(Protocol):
    """What `prepare_job` reads of the job manager: the model's defaults, the tasks it serves, its clock."""

    defaults: ModelDefaults
    tasks: tuple[str, ...]

    def clock(self) -> float: ...


def prepare_job(
    manager: Planner,
    job_id: str,
    request: GenerationRequest,
    *,
    model_name: str,
    max_request_cost: float | None,
    seconds_label: Callable[[GenerationPlan], str],
    sync: bool = False,
) -> tuple[Job, GenerationPlan]:
    """Plan `request` (`RequestError` / `MediaError` naming the field), admit its cost (`TooCostly`; `None`: the
    checkpoint's default limit) and build its job record, ready for `JobManager.submit`."""
    plan = plan_request(request, manager.defaults, manager.tasks)
    check_cost(plan, max_request_cost or default_max_cost(manager.defaults, plan.long_video_mode))
    job = Job.planned(job_id, model_name, request, plan, seconds_label(plan), created_at=int(manager.clock()),
                      sync=sync)
    return job, plan
