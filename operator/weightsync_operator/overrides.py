"""What a WeightSync author may ask of its runtime pod, judged against the installer's allowlist (pure).

The CRD schema refuses what it can judge alone (no serviceAccountName, no secretKeyRef env);
the rest depends on the chart's values, which only the operator knows: which images may run,
which env sources and names are allowed. A refused spec creates nothing (reason
RuntimeOverrideRefused), so the author cannot run code or read Secrets beyond what the installer
granted to every WeightSync.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from sync_runtime.schema.crd import WeightSyncSpec
from weightsync_operator.config import RuntimeDefaults

REASON = "RuntimeOverrideRefused"


def image_allowed(image: str, defaults: RuntimeDefaults) -> bool:
    """The default runtime image always; others only if an allowlist pattern (fnmatch) matches."""
    return image == defaults.image or any(fnmatchcase(image, p) for p in defaults.allowed_images)


def _env_problems(env: list[dict], defaults: RuntimeDefaults) -> list[str]:
    out = []
    for i, entry in enumerate(env):
        where, name = f"spec.runtime.env[{i}]", str(entry.get("name", ""))
        if any(name.startswith(p) for p in defaults.denied_env_prefixes):
            prefixes = ", ".join(defaults.denied_env_prefixes)
            out.append(f"{where}: env name {name!r} is reserved (prefixes {prefixes})")
        sources = sorted((entry.get("valueFrom") or {}).keys())
        if "valueFrom" in entry and not sources:
            out.append(f"{where}: valueFrom names no source")
        for source in sources:
            if source not in defaults.allowed_env_sources:
                allowed = ", ".join(defaults.allowed_env_sources) or "none"
                out.append(f"{where}: valueFrom.{source} is not allowed (allowed: {allowed})")
    return out


def override_problems(spec: WeightSyncSpec, defaults: RuntimeDefaults) -> list[str]:
    """Why the runtime overrides of `spec` are refused, each prefixed by the field path; [] if allowed."""
    rt, out = spec.runtime, []
    if rt.image is not None and not image_allowed(rt.image, defaults):
        out.append(f"spec.runtime.image: {rt.image!r} is not in the operator's allowed runtime images")
    return out + _env_problems(list(rt.env or []), defaults)
