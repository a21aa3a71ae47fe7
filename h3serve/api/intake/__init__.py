"""An HTTP create request made into the `GenerationRequest` the job manager queues.

Two steps, one module each: `read.py` reads the body (multipart, urlencoded or JSON: `body.py`) into the one request
model (`request_model.py`) and its media inputs; `generation_request.py` stores and places the media and resolves the
adapter. The rest serves them: `form_keys.py` (the SDK's bracketed form keys), `json_values.py` (bounded JSON and
the values the model does not type), `field_errors.py` (pydantic's errors as 400s). The media URL fetcher
(`api/url_fetch.py`) and fast percent-decoding (`api/percent.py`) sit beside the package: the app owns the fetcher.
"""
