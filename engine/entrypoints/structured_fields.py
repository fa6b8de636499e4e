"""A request's structured-output fields (OpenAI's ``response_format``, vLLM's ``guided_*`` and
``structured_outputs``) → one ``GuidedDecodingParams``."""

from __future__ import annotations

import dataclasses

from engine.sampling_params import GuidedDecodingParams


def guided_decoding(request) -> GuidedDecodingParams | None:
    """``request``'s constraint, from whichever of its fields sets one (None if none does).
    Raises ValueError naming the fields when several do, or a field that is malformed."""
    given = {name: value for name, value in [
        ("response_format", _response_format(request.response_format)), ("guided_json", request.guided_json),
        ("guided_regex", request.guided_regex), ("guided_choice", request.guided_choice),
        ("guided_grammar", request.guided_grammar), ("structured_outputs", request.structured_outputs)]
        if value is not None}
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} each set a constraint on the output; send one of them")
    if not given:
        return None
    name, value = next(iter(given.items()))
    fields = value if name in ("response_format", "structured_outputs") else {name.removeprefix("guided_"): value}
    if not isinstance(fields, dict):
        raise ValueError(f"{name} must be an object, got {fields!r}")
    known = {field.name for field in dataclasses.fields(GuidedDecodingParams)}
    if set(fields) - known:
        raise ValueError(f"{name} has unknown fields {sorted(set(fields) - known)}; it takes {sorted(known)}")
    extra = {"whitespace_pattern": request.guided_whitespace_pattern, "backend": request.guided_decoding_backend}
    try:
        return GuidedDecodingParams(**{**{k: v for k, v in extra.items() if v is not None}, **fields})
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name}: {error}") from None


def _response_format(response_format: dict | None) -> dict | None:
    """OpenAI's ``response_format`` as ``GuidedDecodingParams``' fields (None for text).
    Raises ValueError for a type this server does not know or a schema that is missing."""
    kind = (response_format or {}).get("type") or "text"
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
        return {"json": schema}
    raise ValueError(f"response_format type {kind!r} is not supported; use 'text', 'json_object' or 'json_schema'")
