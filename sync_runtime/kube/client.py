"""The Kubernetes API client's configuration, as every caller of the API loads it.

In a pod the service account's token (the runtime pod, the trainer in a pod); elsewhere the
user's kubeconfig (`weightsync run` on a laptop, the tests' control plane).
"""

from __future__ import annotations

from collections.abc import Callable


def load_config(unreachable: Callable[[Exception], Exception] | None = None) -> None:
    """Load the in-cluster configuration, else the kubeconfig. When neither exists, raise
    `unreachable(error)` (the caller's one-line error), or the client's own ConfigException."""
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except config.ConfigException as e:
            if unreachable is None:
                raise
            raise unreachable(e) from e
