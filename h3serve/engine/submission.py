"""From a request to a queued job's record: planning, admission by cost and the record, owned by the engine.

The API process only parses the request and answers; what a request becomes (its plan, whether its cost is
admitted, the job that is queued) is decided here, by `JobManager.submit`, the same for every route and the CLI's
tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from h3serve.engine.admission import check_cost, default_max_cost
from h3serve.engine.planning import plan_request
from h3serve.jobstore.records import Job
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import GenerationPlan, ModelDefaults


@dataclass(frozen=True)
class Admission:
    """What the job manager admits: the model name its jobs carry and the cost limit (None: the checkpoint's)."""

    model_name: str
    max_request_cost: float | None = None


@dataclass(frozen=True)
class PreparedJob:
    """A planned and admitted request's job record, ready to queue."""

    job: Job
    plan: GenerationPlan


def prepare_job(
    request: GenerationRequest,
    defaults: ModelDefaults,
    tasks: tuple[str, ...],
    admission: Admission,
    *,
    job_id: str,
    created_at: int,
    seconds: str | None = None,
    sync: bool = False,
    key_scope: str = "",
) -> PreparedJob:
    """Plan `request` (`RequestError` / `MediaError` naming the field), admit its cost (`TooCostly`) and build its
    job record. `seconds`: the job's `seconds` as the client asked (None: the planned duration); `key_scope`: the
    API key that asked (its webhook endpoints get the job's event)."""
    plan = plan_request(request, defaults, tasks)
    check_cost(plan, admission.max_request_cost or default_max_cost(defaults, plan.long_video_mode))
    label = seconds if seconds is not None else f"{plan.duration_s:g}"
    job = Job.planned(job_id, admission.model_name, request, plan, label, created_at=created_at, sync=sync,
                      key_scope=key_scope)
    return PreparedJob(job, plan)
