"""Watches (issue 37): what the event-driven entities wait on. One list, then the changes from
its resourceVersion, until the caller's condition holds; the nodes, the GPU pods and the open
CSRs are each followed this way by their own job."""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import urllib3
from kubernetes.client.exceptions import ApiException

from providers.cluster.kubernetes.api import KubernetesApi, T, _message, _translate


class _Gone(Exception):
    """A watch's resourceVersion is gone (410): list again."""


class Watches(KubernetesApi):
    """List-then-watch of any listable resource, resumed after a lost or expired watch."""

    def _follow(self, what: str, list_fn: Callable[..., Any], convert: Callable[[dict[str, Any]], T | None],
                until: Callable[[list[T]], bool], timeout_s: float, recheck_s: float,
                heartbeat: Callable[[], None] | None, wake_at: Callable[[], float | None] | None = None,
                **selectors: Any) -> list[T]:
        """List, then follow the changes from the list's resourceVersion until ``until`` holds
        for the objects (``convert``: None leaves an object out) or ``timeout_s`` passed.

        The watch runs in chunks of at most ``recheck_s`` (the server's ``timeoutSeconds``), each
        resumed from the last resourceVersion seen (bookmarks included), so ``until`` and
        ``heartbeat`` are called at least that often and a hung connection is given up after one
        chunk. A version the server no longer has (``410 Gone``: etcd compacted past it, or it is
        older than the watch cache) is met by listing again: the objects are then the list's,
        and an event the watch missed is in it.

        No read of the watch waits past ``timeout_s`` nor past ``wake_at()`` (``time.monotonic()``,
        asked before each read; None: no such time), when ``until`` may hold with no event (a
        batch's window closing): the server may send nothing for a whole chunk, so the read is cut
        short then, ``until`` asked, and the next chunk resumes from the last version seen."""
        deadline = time.monotonic() + max(timeout_s, 0.0)

        def next_look() -> float:
            wake = wake_at() if wake_at is not None else None
            return deadline if wake is None else min(deadline, wake)

        objects, version = self._list_for_watch(what, list_fn, convert, **selectors)
        while True:
            current = [objects[key] for key in sorted(objects)]
            if until(current) or time.monotonic() >= deadline:
                return current
            chunk = max(1, int(min(recheck_s, max(deadline - time.monotonic(), 1.0))))
            try:
                for kind, obj in self._watch_chunk(what, list_fn, version, chunk, next_look, **selectors):
                    meta = obj.get("metadata") or {}
                    version = meta.get("resourceVersion") or version
                    if kind == "BOOKMARK":
                        continue
                    key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
                    converted = convert(obj) if kind != "DELETED" else None
                    if converted is None:
                        objects.pop(key, None)
                    else:
                        objects[key] = converted
                    current = [objects[k] for k in sorted(objects)]
                    if until(current):
                        return current
            except _Gone:
                objects, version = self._list_for_watch(what, list_fn, convert, **selectors)
            if heartbeat is not None:
                heartbeat()

    def _list_for_watch(self, what: str, list_fn: Callable[..., Any], convert: Callable[[dict[str, Any]], T | None],
                        **selectors: Any) -> tuple[dict[str, T], str]:
        listed = self._do(f"list {what}", list_fn, **selectors)
        objects: dict[str, T] = {}
        for obj in listed.get("items", []):
            meta = obj.get("metadata") or {}
            if (converted := convert(obj)) is not None:
                objects[f"{meta.get('namespace', '')}/{meta.get('name', '')}"] = converted
        return objects, (listed.get("metadata") or {}).get("resourceVersion", "")

    def _watch_chunk(self, what: str, list_fn: Callable[..., Any], version: str, seconds: int,
                     next_look: Callable[[], float], **selectors: Any):
        """(type, object) of each watch event from ``version`` for ``seconds`` (plain JSON), each
        read waiting no later than ``next_look()`` (``time.monotonic()``): the chunk ends there."""
        from kubernetes.watch.watch import iter_resp_lines

        # The server ends the chunk after ``seconds``; a read waiting longer than that (and a
        # connect timeout) is a hung connection.
        hung_after = seconds + self.request_timeout[0]
        try:
            response = self._send(f"watch {what}", list_fn, watch=True, resource_version=version,
                                  timeout_seconds=seconds, allow_watch_bookmarks=True, _preload_content=False,
                                  _request_timeout=(self.request_timeout[0], hung_after), **selectors)
        except ApiException as error:
            if error.status == 410:
                raise _Gone(_message(error)) from error
            raise _translate(error, f"watch {what}") from error
        lines = iter_resp_lines(response)
        try:
            while True:
                _read_waits_at_most(response, min(hung_after, next_look() - time.monotonic()))
                line = next(lines, None)
                if line is None:
                    return
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone(obj.get("message", "resourceVersion too old"))
                    raise _translate(ApiException(status=obj.get("code") or 500, reason=obj.get("message", "")),
                                     f"watch {what}")
                yield event.get("type", ""), obj
        except (urllib3.exceptions.ReadTimeoutError, urllib3.exceptions.ProtocolError, OSError):
            # The chunk's connection ended early, hung, or its read was cut at ``next_look``: the
            # next chunk resumes from the last version seen (a line cut in half was not applied).
            return
        finally:
            response.close()
            response.release_conn()


#: A read of a watch waits at least this long (a socket timeout of 0 would not block at all).
MIN_READ_WAIT_SECONDS = 0.05


def _read_waits_at_most(response: urllib3.BaseHTTPResponse, seconds: float) -> None:
    """The watch response's next read from its socket gives up after ``seconds`` (``ReadTimeoutError``).
    The client's read timeout is set once per request; a socket's own is changed between reads."""
    sock = getattr(response.connection, "sock", None)
    if sock is not None:
        sock.settimeout(max(seconds, MIN_READ_WAIT_SECONDS))
