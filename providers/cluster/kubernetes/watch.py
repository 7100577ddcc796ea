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
                heartbeat: Callable[[], None] | None, **selectors: Any) -> list[T]:
        """List, then follow the changes from the list's resourceVersion until ``until`` holds
        for the objects (``convert``: None leaves an object out) or ``timeout_s`` passed.

        The watch runs in chunks of at most ``recheck_s`` (the server's ``timeoutSeconds``), each
        resumed from the last resourceVersion seen (bookmarks included), so ``until`` and
        ``heartbeat`` are called at least that often and a hung connection is given up after one
        chunk. A version the server no longer has (``410 Gone``: etcd compacted past it, or it is
        older than the watch cache) is met by listing again: the objects are then the list's,
        and an event the watch missed is in it."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        objects, version = self._list_for_watch(what, list_fn, convert, **selectors)
        while True:
            current = [objects[key] for key in sorted(objects)]
            if until(current) or time.monotonic() >= deadline:
                return current
            chunk = max(1, int(min(recheck_s, max(deadline - time.monotonic(), 1.0))))
            try:
                for kind, obj in self._watch_chunk(what, list_fn, version, chunk, **selectors):
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

    def _watch_chunk(self, what: str, list_fn: Callable[..., Any], version: str, seconds: int, **selectors: Any):
        """(type, object) of each watch event from ``version`` for ``seconds`` (plain JSON)."""
        from kubernetes.watch.watch import iter_resp_lines

        try:
            response = self._send(f"watch {what}", list_fn, watch=True, resource_version=version,
                                  timeout_seconds=seconds, allow_watch_bookmarks=True, _preload_content=False,
                                  _request_timeout=(self.request_timeout[0], seconds + self.request_timeout[0]),
                                  **selectors)
        except ApiException as error:
            if error.status == 410:
                raise _Gone(_message(error)) from error
            raise _translate(error, f"watch {what}") from error
        try:
            for line in iter_resp_lines(response):
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
            return  # the chunk's connection ended early or hung: the next chunk resumes from ``version``
        finally:
            response.close()
            response.release_conn()
