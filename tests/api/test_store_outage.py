"""A job database outage is the server's condition, not the client's: 503 `store_unavailable` with Retry-After,
and the same server answers normally once the database is back (it reconnects on the next call)."""

from __future__ import annotations

import psycopg
from fake_executor import FakeExecutor
from fastapi.testclient import TestClient

from h3serve.api.app import create_app
from h3serve.api.server_config import ServerConfig
from h3serve.engine.jobs import JobManager
from h3serve.jobstore import open_job_store
from h3serve.jobstore.job_files import JobFiles
from h3serve.jobstore.records import Job, new_job_id
from h3serve.rules.request import GenerationRequest
from h3serve.rules.validate import validate


def _allow_connections(url: str, allowed: bool) -> None:
    """As a database restart would: no new connection, and every open one of the database's dropped."""
    name = psycopg.conninfo.conninfo_to_dict(url)["dbname"]
    admin_url = psycopg.conninfo.make_conninfo(url, dbname="postgres")
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS {str(allowed).lower()}')
        if not allowed:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))


def test_an_unreachable_job_database_is_503_then_service_resumes(postgres_url, tmp_path):
    store = open_job_store(postgres_url)
    config = ServerConfig(served_model_name="tiny", data_dir=tmp_path, job_store=postgres_url).validate()
    # Not started: no runner claims.
    manager = JobManager(FakeExecutor(), store, JobFiles(tmp_path / "jobs"), model_name="tiny")
    request = GenerationRequest(prompt="waves", width=128, height=64, duration_s=4, steps=1)
    job = store.insert(Job.planned(new_job_id(), "tiny", request, validate(request, manager.defaults), "4", 0))
    client = TestClient(create_app(config, manager, store))
    assert client.get(f"/v1/videos/{job.id}").status_code == 200

    _allow_connections(postgres_url, False)
    try:
        for method, path in (("GET", f"/v1/videos/{job.id}"), ("GET", "/v1/videos"), ("DELETE", f"/v1/videos/{job.id}"),
                             ("POST", "/v1/videos")):
            response = client.request(method, path, json={"prompt": "x"} if method == "POST" else None)
            assert response.status_code == 503, (method, path, response.text)
            error = response.json()["error"]
            assert error["code"] == "store_unavailable" and "retry" in error["message"]
            assert response.headers["retry-after"] == "5"
    finally:
        _allow_connections(postgres_url, True)
    assert client.get(f"/v1/videos/{job.id}").json()["id"] == job.id  # reconnected, nothing lost
    store.close()


def test_a_request_reaching_a_closed_store_is_503_shutting_down(tmp_path):
    """Past the shutdown's wait for requests the store closes; one that comes later is told the server stops."""
    store = open_job_store(tmp_path / "jobs.sqlite3")
    config = ServerConfig(served_model_name="tiny", data_dir=tmp_path).validate()
    manager = JobManager(FakeExecutor(), store, JobFiles(tmp_path / "jobs"), model_name="tiny")
    client = TestClient(create_app(config, manager, store))
    store.close()
    for method, path in (("GET", f"/v1/videos/{new_job_id()}"), ("GET", "/v1/videos")):
        response = client.request(method, path)
        assert response.status_code == 503, (method, path, response.text)
        assert response.json()["error"]["code"] == "shutting_down" and response.headers["retry-after"] == "5"
