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
ENV_ALLOWED_IMAGES = "WEIGHTSYNC_RUNTIME_ALLOWED_IMAGES"
ENV_ALLOWED_ENV_SOURCES = "WEIGHTSYNC_RUNTIME_ALLOWED_ENV_SOURCES"
ENV_DENIED_ENV_PREFIXES = "WEIGHTSYNC_RUNTIME_DENIED_ENV_PREFIXES"
DEFAULT_ENV_SOURCES = ("fieldRef", "resourceFieldRef")
DEFAULT_DENIED_ENV_PREFIXES = ("KUBERNETES_", "LD_", "PYTHON", "WEIGHTSYNC_")
"""KUBERNETES_* would send the runtime's token to another API server; LD_*/PYTHON* load other code."""


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
    allowed_images: tuple[str, ...] = ()
    """fnmatch patterns of images spec.runtime.image may name besides `image` (installer-owned)."""
    allowed_env_sources: tuple[str, ...] = DEFAULT_ENV_SOURCES
    """valueFrom sources spec.runtime.env may use (never secretKeyRef: the CRD refuses it)."""
    denied_env_prefixes: tuple[str, ...] = DEFAULT_DENIED_ENV_PREFIXES


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorConfig:
    runtime: RuntimeDefaults = field(default_factory=RuntimeDefaults)
    metrics_port: int = 8080
    bind_address: str = "127.0.0.1"
    """Where /metrics listens: the chart sets the pod IP (scraped there); loopback otherwise."""
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
        secrets = _names(environ, ENV_RUNTIME_PULL_SECRETS, ())
        runtime = RuntimeDefaults(
            image=environ.get(ENV_RUNTIME_IMAGE) or base.image,
            service_account_name=environ.get(ENV_RUNTIME_SERVICE_ACCOUNT) or base.service_account_name,
            image_pull_policy=environ.get(ENV_RUNTIME_PULL_POLICY) or base.image_pull_policy,
            image_pull_secrets=secrets,
            env=env,
            allowed_images=_names(environ, ENV_ALLOWED_IMAGES, ()),
            allowed_env_sources=_names(environ, ENV_ALLOWED_ENV_SOURCES, DEFAULT_ENV_SOURCES),
            denied_env_prefixes=_names(environ, ENV_DENIED_ENV_PREFIXES, DEFAULT_DENIED_ENV_PREFIXES),
        )
        return cls(
            runtime=runtime,
            metrics_port=_number(environ, ENV_METRICS_PORT, 8080, int),
            bind_address=environ.get(ENV_BIND_ADDRESS) or "127.0.0.1",
            reconcile_interval_seconds=_number(environ, ENV_RECONCILE_INTERVAL, 5.0, float),
        )


def _names(environ: Mapping[str, str], name: str, default: tuple[str, ...]) -> tuple[str, ...]:
    """A comma-separated list; unset means `default`, set but empty means none."""
    if name not in environ:
        return default
    return tuple(x.strip() for x in environ[name].split(",") if x.strip())


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
