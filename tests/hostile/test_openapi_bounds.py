"""Every integer bound the OpenAPI document states is an integer and is the bound the server enforces, on every
route: read from the served /openapi.json, each bound is probed (accepted: no 400 naming the field) and one past
it (a 400 naming the field), in JSON on every route and as a form on /v1/videos (the forms' bounds are compared
with the JSON bodies' on every route). The audit found /v1/videos publishing a seed maximum of 2**63 - 1024 while
2**63 - 1 was accepted, and /edits, /extensions and /sync publishing 9.223372036854775e+18 (2**63, refused) and
`minimum: 0.0`. Every number field states a finite range (`control_context_scale: 1e308` was accepted)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from fake_executor import CLIENT_FAIL_PROMPT, FakeExecutor
from hostile_servers import serve

from h3serve.api.url_fetch import MediaFetcher

UNKNOWN = "video_0123456789abcdef0123456789abcdef"
# Each route's smallest body (the job a bound makes is deleted at once; a sync job fails by its prompt, 400).
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/videos": {"prompt": "x"},
    "/v1/videos/sync": {"prompt": CLIENT_FAIL_PROMPT, "num_inference_steps": 1},
    "/v1/videos/{video_id}/remix": {"prompt": "x"},
    "/v1/videos/edits": {"prompt": "x", "video": {"id": UNKNOWN}},
    "/v1/videos/extensions": {"prompt": "x", "seconds": "4", "video": {"id": UNKNOWN}},
}
CONTINUATION = {"long_video": True, "long_video_mode": "continuation"}
# What a field's bound needs beside it to be a request the server runs (else a rule between fields would answer).
COMPANIONS: dict[str, dict[str, Any]] = {
    "num_frames": CONTINUATION,  # the schema's bound is the longest mode's (300 s by continuation)
    "continuation_window_frames": CONTINUATION,
    "continuation_overlap_frames": {**CONTINUATION, "continuation_window_frames": 345},
    # a refresh hint needs a DiT cache to act on and at least as many forwards as its own value
    "force_refresh_step_hint": {"quality": "high", "num_inference_steps": 200},
}


async def _no_network(host: str, port: int) -> list[str]:
    raise OSError("name resolution is disabled in this test")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("data"), executor=FakeExecutor(step_s=0.0005), max_queue=100_000,
               fetcher=MediaFetcher(2.0, resolver=_no_network)) as running:
        yield running


@pytest.fixture(scope="module")
def document(server) -> dict[str, Any]:
    with server.client() as client:
        return client.get("/openapi.json").json()


def integer_bounds(schema: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(dotted field, its integer schema) for every integer property with a bound, objects walked."""
    for name, node in schema.get("properties", {}).items():
        for option in node.get("anyOf", [node]):
            if option.get("type") == "integer" and ("minimum" in option or "maximum" in option):
                yield prefix + name, option
            if option.get("type") == "object" or "properties" in option:
                yield from integer_bounds(option, f"{prefix}{name}.")


def number_fields(node: Any, where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        if node.get("type") == "number":
            yield where, node
        for key, child in node.items():
            yield from number_fields(child, f"{where}/{key}")
    elif isinstance(node, list):
        for i, child in enumerate(node):
            yield from number_fields(child, f"{where}[{i}]")


def _nested(field: str, value: Any) -> dict[str, Any]:
    body: dict[str, Any] = {}
    *parents, leaf = field.split(".")
    node = body
    for parent in parents:
        node = node.setdefault(parent, {})
    node[leaf] = value
    return body


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) and key != "video" else value
    return out


def _send(client, path: str, encoding: str, field: str, value: int, bound: int):
    leaf = field.split(".")[-1]
    body = _merge(_merge(ROUTES[path], COMPANIONS.get(leaf, {})), _nested(field, value))
    if leaf in ("width", "height"):  # the other edge alongside, at the bound: a square canvas at the bound
        body[{"width": "height", "height": "width"}[leaf]] = bound
    url = path.replace("{video_id}", UNKNOWN)
    if encoding == "application/json":
        response = client.post(url, json=body)
    else:
        form = {k: v if isinstance(v, str) else json.dumps(v) if isinstance(v, dict | bool) else str(v)
                for k, v in body.items()}
        response = client.post(url, data=form)
    if response.status_code == 200 and path == "/v1/videos":
        client.delete(f"/v1/videos/{response.json()['id']}")  # stop the job the probe made
    return response


def _refused_for(response, field: str) -> bool:
    if response.status_code != 400:
        return False
    error = response.json()["error"]
    return error["param"] == field and error["code"] == "invalid_value"


def test_every_integer_bound_is_an_integer_the_server_enforces_on_every_route(server, document):
    probes = 0
    with server.client() as client:
        for path in ROUTES:
            content = document["paths"][path]["post"]["requestBody"]["content"]
            assert set(content) >= {"application/json", "application/x-www-form-urlencoded"}, path
            # A form (and multipart, which adds files) states the JSON body's top-level fields with the same bounds:
            # probed over the wire on /v1/videos, compared here on every route.
            json_top = {f: b for f, b in integer_bounds(content["application/json"]["schema"]) if "." not in f}
            for form in ("application/x-www-form-urlencoded", "multipart/form-data"):
                if form in content:
                    assert dict(integer_bounds(content[form]["schema"])) == json_top, (path, form)
            encodings = ("application/json", "application/x-www-form-urlencoded")
            for encoding in encodings if path == "/v1/videos" else encodings[:1]:
                bounds = list(integer_bounds(content[encoding]["schema"]))
                assert {"seed", "num_inference_steps", "width", "num_frames"} <= {f for f, _ in bounds}, path
                for field, schema in bounds:
                    for key, step in (("maximum", 1), ("minimum", -1)):
                        if key not in schema:
                            continue
                        bound = schema[key]
                        assert type(bound) is int, f"{path} {encoding} {field}: {key} {bound!r} is not an integer"
                        within = _send(client, path, encoding, field, bound, bound)
                        assert within.status_code < 500 and not _refused_for(within, field), (
                            f"{path} {encoding} {field}={bound} (the published {key}) was refused: {within.text}")
                        past = _send(client, path, encoding, field, bound + step, bound)
                        assert _refused_for(past, field), (
                            f"{path} {encoding} {field}={bound + step} (past the published {key}) was not refused "
                            f"naming the field: {past.status_code} {past.text[:300]}")
                        assert str(bound) in past.json()["error"]["message"], past.text  # the limit, exactly
                        probes += 2
        # Query parameters: the page size and an output's index.
        job = client.post("/v1/videos", json={"prompt": "x"}).json()["id"]
        for path, name in (("/v1/videos", "limit"), (f"/v1/videos/{job}/content", "index")):
            spec = next(p for p in document["paths"][path.replace(job, "{video_id}")]["get"]["parameters"]
                        if p["name"] == name)["schema"]
            for key, step in (("maximum", 1), ("minimum", -1)):
                bound = spec[key]
                assert type(bound) is int, (path, name, bound)
                assert not _refused_for(client.get(path, params={name: bound}), name)
                assert _refused_for(client.get(path, params={name: bound + step}), name)
                probes += 2
        client.delete(f"/v1/videos/{job}")
    print(f"FIGURE OpenAPI bound probe: {probes} requests over {len(ROUTES)} routes and 2 query parameters")
    assert probes > 150


def test_every_number_field_states_a_finite_range(document):
    for path, item in document["paths"].items():
        for method, operation in item.items():
            for where, schema in number_fields(operation.get("requestBody", {})):
                low = schema.get("minimum", schema.get("exclusiveMinimum"))
                high = schema.get("maximum", schema.get("exclusiveMaximum"))
                assert low is not None and high is not None, f"{method} {path}{where}: {schema}"
                assert math.isfinite(low) and math.isfinite(high), f"{method} {path}{where}: {schema}"
