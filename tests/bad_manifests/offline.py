"""An offline stand-in for the API server's structural-schema checks (tests only).

Walks a CRD openAPIV3Schema the way kube-apiserver does for what these tests need: defaulting,
unknown fields (as strict field validation reports them), types, required, enum, numeric bounds,
string length and pattern, list sizes. Messages copy the API server's wording, so the bad-manifest
table's expected texts are checked here before the e2e suite checks them against a real server.
CEL rules are not evaluated here; sync_runtime.schema.crd.spec_problems mirrors them.
"""

from __future__ import annotations

import copy
import re
from typing import Any

_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", dict: "object", list: "array"}


def _type_name(value: Any) -> str:
    return _TYPES.get(type(value), type(value).__name__)


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Structural defaulting: missing properties with a `default` get it, recursively."""
    obj = copy.deepcopy(obj)
    if isinstance(obj, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                obj[key] = apply_defaults(sub, obj[key])
    elif isinstance(obj, list) and "items" in schema:
        obj = [apply_defaults(schema["items"], item) for item in obj]
    return obj


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_ok(schema: dict[str, Any], value: Any) -> bool:
    if schema.get("x-kubernetes-int-or-string"):
        return isinstance(value, (int, str)) and not isinstance(value, bool)
    want = schema.get("type")
    if want is None:
        return True
    if want == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if want == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return _type_name(value) == want


def schema_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    if not _type_ok(schema, value):
        return [
            f'{path}: Invalid value: "{_type_name(value)}": {path} in body must be of type '
            f'{schema["type"]}: "{_type_name(value)}"'
        ]
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(f'"{e}"' for e in schema["enum"])
        errors.append(f'{path}: Unsupported value: "{value}": supported values: {allowed}')
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(
                f"{path}: Invalid value: {value}: {path} in body should be greater than or equal to "
                f"{schema['minimum']}"
            )
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(
                f"{path}: Invalid value: {value}: {path} in body should be less than or equal to "
                f"{schema['maximum']}"
            )
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{path} in body should be at least {schema['minLength']} chars long")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: Too long: may not be more than {schema['maxLength']} bytes")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(
                f"{path}: Invalid value: \"{value}\": {path} in body should match '{schema['pattern']}'"
            )
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(
                f"{path}: Invalid value: {len(value)}: {path} in body should have at least "
                f"{schema['minItems']} items"
            )
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path} in body should have at most {schema['maxItems']} items")
        for i, item in enumerate(value):
            errors += schema_errors(schema.get("items", {}), item, f"{path}[{i}]")
    if isinstance(value, dict):
        errors += _object_errors(schema, value, path)
    return errors


def _object_errors(schema: dict[str, Any], value: dict[str, Any], path: str) -> list[str]:
    errors = [f"{_join(path, key)}: Required value" for key in schema.get("required", []) if key not in value]
    props = schema.get("properties")
    extra = schema.get("additionalProperties")
    for key, item in value.items():
        if props is not None and key in props:
            if key != "metadata":
                errors += schema_errors(props[key], item, _join(path, key))
        elif isinstance(extra, dict):
            errors += schema_errors(extra, item, _join(path, key))
        elif not schema.get("x-kubernetes-preserve-unknown-fields") and props is not None:
            errors.append(f'unknown field "{_join(path, key)}"')
    return errors
