"""A job's notices: the changes made to its request that its caller did not ask for, reported with the job.

Rules a reader must know:
- A notice is a `stages_pb2.Notice` (field, given, used, message, source). A job's notices are first its
  front end's (`GenerateRequest.notices`, e.g. the HTTP gateway's `seconds` made a frame count), taken out of
  the request it stores (`take_request_notices`), then those its stages report as they run (the text
  encoder's truncated prompts), in that order.
- A notice the job already has is not added again (`merge`), so a stage run again by a retry or after a
  restart does not repeat its notices.
- The store keeps them in the job's row as JSON (`to_json`, `from_json`); the front end's are bounded by
  request_bounds.py before they get here, a stage's are made by the stage.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from google.protobuf.json_format import MessageToDict, ParseDict

from stagediff.v1 import generation_pb2, stages_pb2


def take_request_notices(
    request: generation_pb2.GenerateRequest,
) -> tuple[generation_pb2.GenerateRequest, list[stages_pb2.Notice]]:
    """(the request without its notices, the notices it carried): the job reports them, its request keeps none."""
    notices = list(request.notices)
    if not notices:
        return request, []
    stripped = generation_pb2.GenerateRequest()
    stripped.CopyFrom(request)
    stripped.ClearField("notices")
    return stripped, notices


def merge(existing: Iterable[stages_pb2.Notice], added: Iterable[stages_pb2.Notice]) -> list[stages_pb2.Notice]:
    """`existing` followed by each of `added` that is not among them already."""
    merged = list(existing)
    for notice in added:
        if notice not in merged:
            merged.append(notice)
    return merged


def to_json(notices: Iterable[stages_pb2.Notice]) -> str:
    """The notices as the store's `notices` column holds them: a JSON list of objects."""
    return json.dumps([MessageToDict(notice, preserving_proto_field_name=True) for notice in notices])


def from_json(text: str) -> list[stages_pb2.Notice]:
    """The notices of a `notices` column (unknown keys, from a newer version, are ignored)."""
    return [ParseDict(item, stages_pb2.Notice(), ignore_unknown_fields=True) for item in json.loads(text or "[]")]
