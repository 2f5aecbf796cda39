"""The operator's own Kubernetes client calls (pods only); kopf does the rest."""

from __future__ import annotations

import json
import logging
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

log = logging.getLogger("weightsync.operator")


def load_config() -> None:
    """In-cluster credentials in a pod, else $KUBECONFIG / ~/.kube/config (local runs, tests)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


class PodApiError(RuntimeError):
    """The API server refused a pod write (e.g. a missing ServiceAccount); the message is the server's."""


class KubePodApi:
    """PodApi over the official client. 404 on delete and 409 on create mean "already done"."""

    def __init__(self, core: client.CoreV1Api | None = None) -> None:
        self.core = core or client.CoreV1Api()

    def create_pod(self, namespace: str, body: dict[str, Any]) -> None:
        try:
            self.core.create_namespaced_pod(namespace, body)
        except ApiException as e:
            if e.status != 409:
                raise PodApiError(_reason(e)) from e
            log.info("runtime pod %s/%s exists already", namespace, body["metadata"]["name"])

    def delete_pod(self, namespace: str, name: str, uid: str | None) -> None:
        # The uid precondition keeps a stale view from deleting the pod's replacement (same name).
        options = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid) if uid else None)
        try:
            self.core.delete_namespaced_pod(name, namespace, body=options)
        except ApiException as e:
            if e.status not in (404, 409):
                raise PodApiError(_reason(e)) from e


def _reason(e: ApiException) -> str:
    try:
        return str(json.loads(e.body or "{}").get("message") or e.reason)
    except ValueError:
        return str(e.reason)
