"""HTTP plumbing shared by the remote rollout engine (rollout/remote/engine.py) and remote judges: one JSON call, its errors.

`http_json` makes one call and sorts its failures: `Transient` for those worth retrying (connection
refused / reset / closed, a read timeout, HTTP 5xx, 408, 429, a reply that is not JSON), `HTTPStatus`
(a RemoteRolloutError) for the other error answers.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass

TRANSIENT_HTTP = (408, 429, 500, 502, 503, 504)


class RemoteRolloutError(RuntimeError):
    """A rollout server failed (after retries, or with a non-transient error)."""


class Transient(Exception):
    """A failure worth retrying."""


class HTTPStatus(RemoteRolloutError):
    """A non-transient HTTP error answer (its status in `code`)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class Server:
    """One rollout server: its URL, the requests in flight to it and served by it, its endpoint."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.outstanding = 0
        self.served = 0
        self.labelled = False  # offers /inference/v1/generate (weight version spans per response)


@dataclass
class Reply:
    """One prompt's samples from one server: token ids and log-probs per sample, and the weight
    version labels each sample was produced under (labelled: its tokens' spans; bracketed: the
    server's label before and after the request)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    server: Server
    labels: list[set]


def http_json(url: str, body: dict | None, timeout: float, headers: dict[str, str] | None = None) -> dict | None:
    """One HTTP call (POST with a JSON body, or GET when body is None) -> the JSON reply (None if empty).
    headers: sent besides Content-Type (e.g. Authorization); never part of an error message.
    Raises Transient for failures worth retrying and HTTPStatus (a RemoteRolloutError) for the others."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:500].decode(errors="replace")
        if e.code in TRANSIENT_HTTP:
            raise Transient(f"{url}: HTTP {e.code}: {detail}") from e
        raise HTTPStatus(f"{url} answered HTTP {e.code}: {detail}", e.code) from e
    except (http.client.HTTPException, OSError) as e:  # URLError, ConnectionError, TimeoutError are OSErrors
        reason = getattr(e, "reason", e)
        raise Transient(f"{url}: {type(reason).__name__}: {reason}") from e
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise Transient(f"{url}: reply is not JSON ({raw[:200]!r})") from e


def reply_choices(reply: dict | None, want: int, server: Server, what: str) -> list[dict]:
    choices = sorted((reply or {}).get("choices") or [], key=lambda c: c.get("index", 0))
    if len(choices) != want:
        raise RemoteRolloutError(f"remote rollout: {server.url} returned {len(choices)} choices for {what}, "
                                 f"expected {want}")
    return choices


def no_ids_error(server: Server, what: str) -> RemoteRolloutError:
    return RemoteRolloutError(
        f"remote rollout: {server.url} returned no token ids with log-probs for {what}; the server must accept "
        "token-id prompts and logprobs with return_token_ids or return_tokens_as_token_ids")
