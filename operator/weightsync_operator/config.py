"""Operator settings, read once from the environment the Helm chart sets (values.yaml documents each)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ENV_RUNTIME_IMAGE = "WEIGHTSYNC_RUNTIME_IMAGE"
ENV_RUNTIME_SERVICE_ACCOUNT = "WEIGHTSYNC_RUNTIME_SERVICE_ACCOUNT"
ENV_RUNTIME_PULL_POLICY = "WEIGHTSYNC_RUNTIME_IMAGE_PULL_POLICY"
ENV_RUNTIME_PULL_SECRETS = "WEIGHTSYNC_RUNTIME_IMAGE_PULL_SECRETS"
ENV_RUNTIME_ENV = "WEIGHTSYNC_RUNTIME_ENV"
ENV_METRICS_PORT = "WEIGHTSYNC_METRICS_PORT"
ENV_BIND_ADDRESS = "WEIGHTSYNC_BIND_ADDRESS"
ENV_RECONCILE_INTERVAL = "WEIGHTSYNC_RECONCILE_INTERVAL_SECONDS"


class ConfigError(ValueError):
    """An operator env var that cannot be used; the message names it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeDefaults:
    """What a runtime pod gets when its WeightSync's spec.runtime does not say."""

    image: str = "weightsync:latest"
    service_account_name: str = "weightsync-runtime"
    """Created by the chart (with its least-privilege Role) in each runtime namespace."""
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    env: tuple[dict[str, Any], ...] = ()
    """EnvVar dicts added to every runtime pod (before spec.runtime.env)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorConfig:
    runtime: RuntimeDefaults = field(default_factory=RuntimeDefaults)
    metrics_port: int = 8080
    bind_address: str = "0.0.0.0"
    """Where /metrics listens: all interfaces in a pod (scraped on the pod IP); 127.0.0.1 in tests."""
    reconcile_interval_seconds: float = 5.0
    """Timer period: how soon pod deaths and backoff deadlines are noticed (runtime reports are immediate)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> OperatorConfig:
        base = RuntimeDefaults()
        try:
            env = tuple(json.loads(environ.get(ENV_RUNTIME_ENV) or "[]"))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{ENV_RUNTIME_ENV}: not a JSON list of EnvVar objects: {e}") from e
        if not all(isinstance(e, dict) and "name" in e for e in env):
            raise ConfigError(f"{ENV_RUNTIME_ENV}: every entry needs a 'name'")
        secrets = tuple(s.strip() for s in environ.get(ENV_RUNTIME_PULL_SECRETS, "").split(",") if s.strip())
        runtime = RuntimeDefaults(
            image=environ.get(ENV_RUNTIME_IMAGE) or base.image,
            service_account_name=environ.get(ENV_RUNTIME_SERVICE_ACCOUNT) or base.service_account_name,
            image_pull_policy=environ.get(ENV_RUNTIME_PULL_POLICY) or base.image_pull_policy,
            image_pull_secrets=secrets,
            env=env,
        )
        return cls(
            runtime=runtime,
            metrics_port=_number(environ, ENV_METRICS_PORT, 8080, int),
            bind_address=environ.get(ENV_BIND_ADDRESS) or "0.0.0.0",
            reconcile_interval_seconds=_number(environ, ENV_RECONCILE_INTERVAL, 5.0, float),
        )


def _number(environ: Mapping[str, str], name: str, default: float, kind: type) -> Any:
    raw = environ.get(name)
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError as e:
        raise ConfigError(f"{name}={raw!r}: not a {kind.__name__}") from e
    if value <= 0:
        raise ConfigError(f"{name}={raw!r}: must be > 0")
    return value
