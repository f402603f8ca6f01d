#!/usr/bin/env python3
"""Validate custom resources offline against their CRDs' own openAPIV3Schema.

    crdcheck.py --crd CRD.yaml [--crd CRD.yaml ...] MANIFEST.yaml [MANIFEST.yaml ...]

For every document of the manifests whose apiVersion and kind a given CRD serves, the document is
checked the way the API server checks a structural schema, as strictly as `kubectl apply
--validate=strict`: types (integer vs. string vs. boolean; `x-kubernetes-int-or-string`,
`nullable`), enums, patterns, lengths, bounds, int32/int64 ranges, item and property counts,
required fields, `allOf` / `anyOf` / `oneOf` / `not`, the uniqueness of `x-kubernetes-list-type`
set and map lists, and unknown fields: a field the schema does not declare is an error, except
under `x-kubernetes-preserve-unknown-fields` or a schema-typed `additionalProperties` (the API
server would prune it, so it is a typo). Top-level `metadata` is checked as ObjectMeta (known
keys, a DNS-subdomain name, label syntax); duplicate YAML keys are errors.

Not evaluated: CEL rules (`x-kubernetes-validations`; their number is reported), defaulting
(a required field with a default counts as present; list-map keys take their defaults), and
anything only a controller or admission webhook checks.

A document in a built-in group (v1, apps/v1, ...) is reported as `builtin` and left to
kubernetes-validate. A document of any other group with no CRD given is an error.

Output: one line per document (`ok`, `builtin`, or `ERROR ... path: message`), then a summary.
Exit status: 0 when every custom resource is valid, 1 on a schema error, 2 on bad input.
"""

import argparse
import math
import re
import sys

import yaml

LOADER_BASE = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# API groups served by kube-apiserver itself (apiVersion "v1" is the core group "").
BUILTIN_GROUPS = {
    "",
    "admissionregistration.k8s.io",
    "apiextensions.k8s.io",
    "apiregistration.k8s.io",
    "apps",
    "authentication.k8s.io",
    "authorization.k8s.io",
    "autoscaling",
    "batch",
    "certificates.k8s.io",
    "coordination.k8s.io",
    "discovery.k8s.io",
    "events.k8s.io",
    "flowcontrol.apiserver.k8s.io",
    "internal.apiserver.k8s.io",
    "networking.k8s.io",
    "node.k8s.io",
    "policy",
    "rbac.authorization.k8s.io",
    "resource.k8s.io",
    "scheduling.k8s.io",
    "storage.k8s.io",
    "storagemigration.k8s.io",
}

OBJECT_META_KEYS = {
    "name", "generateName", "namespace", "labels", "annotations", "finalizers",
    "ownerReferences", "uid", "resourceVersion", "generation", "creationTimestamp",
    "deletionTimestamp", "deletionGracePeriodSeconds", "managedFields", "selfLink",
}
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


class StrictLoader(LOADER_BASE):
    """A safe loader that refuses duplicate mapping keys (kubectl refuses them too)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_all(path, loader=LOADER_BASE):
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.load_all(f, Loader=loader) if d is not None]


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v):
    return (is_int(v) or isinstance(v, float)) and not (isinstance(v, float) and math.isnan(v))


TYPE_CHECKS = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": is_int,
    "number": is_number,
    "boolean": lambda v: isinstance(v, bool),
}


def fmt_path(path):
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "<root>"


class Checker:
    def __init__(self):
        self.patterns = {}
        self.cel_rules = 0

    def pattern(self, p):
        if p not in self.patterns:
            self.patterns[p] = re.compile(p)
        return self.patterns[p]

    def check(self, value, schema, path, errs, strict=True):
        """Appends (path, message) for every violation of `schema` by `value`. `strict` is off
        inside anyOf/oneOf/not branches, which only carry value validations."""
        if value is None:
            if not schema.get("nullable"):
                errs.append((path, "null is not allowed here"))
            return
        self.cel_rules += len(schema.get("x-kubernetes-validations", ()))
        if schema.get("x-kubernetes-int-or-string"):
            if not (is_int(value) or isinstance(value, str)):
                errs.append((path, f"{value!r} must be an integer or a string"))
                return
        t = schema.get("type")
        if t and not TYPE_CHECKS.get(t, lambda v: True)(value):
            errs.append((path, f"{value!r} is not of type {t!r}"))
            return
        if "enum" in schema and value not in schema["enum"]:
            errs.append((path, f"{value!r} is not one of {schema['enum']}"))
        if isinstance(value, str):
            self.check_string(value, schema, path, errs)
        elif is_number(value):
            self.check_number(value, schema, path, errs)
        elif isinstance(value, list):
            self.check_array(value, schema, path, errs, strict)
        elif isinstance(value, dict):
            self.check_object(value, schema, path, errs, strict)
        for sub in schema.get("allOf", ()):
            self.check(value, sub, path, errs, strict=False)
        if "anyOf" in schema:
            if not any(self.passes(value, sub, path) for sub in schema["anyOf"]):
                errs.append((path, f"{value!r} matches none of the allowed forms (anyOf)"))
        if "oneOf" in schema:
            n = sum(self.passes(value, sub, path) for sub in schema["oneOf"])
            if n != 1:
                errs.append((path, f"matches {n} of the oneOf forms, not exactly 1"))
        if "not" in schema and self.passes(value, schema["not"], path):
            errs.append((path, "matches a form that is not allowed (not)"))

    def passes(self, value, schema, path):
        errs = []
        rules = self.cel_rules
        self.check(value, schema, path, errs, strict=False)
        self.cel_rules = rules
        return not errs

    def check_string(self, value, schema, path, errs):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errs.append((path, f"{value!r} is shorter than {schema['minLength']}"))
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errs.append((path, f"{value!r} is longer than {schema['maxLength']}"))
        if "pattern" in schema and not self.pattern(schema["pattern"]).search(value):
            errs.append((path, f"{value!r} does not match the pattern {schema['pattern']}"))

    def check_number(self, value, schema, path, errs):
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if lo is not None and (value < lo or (schema.get("exclusiveMinimum") and value == lo)):
            errs.append((path, f"{value} is below the minimum {lo}"))
        if hi is not None and (value > hi or (schema.get("exclusiveMaximum") and value == hi)):
            errs.append((path, f"{value} is above the maximum {hi}"))
        m = schema.get("multipleOf")
        if m and (value / m) != int(value / m):
            errs.append((path, f"{value} is not a multiple of {m}"))
        rng = INT_RANGES.get(schema.get("format"))
        if rng and is_int(value) and not rng[0] <= value <= rng[1]:
            errs.append((path, f"{value} does not fit {schema['format']}"))

    def check_array(self, value, schema, path, errs, strict):
        if "minItems" in schema and len(value) < schema["minItems"]:
            errs.append((path, f"has {len(value)} items, fewer than {schema['minItems']}"))
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errs.append((path, f"has {len(value)} items, more than {schema['maxItems']}"))
        items = schema.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(value):
                self.check(item, items, path + [i], errs, strict)
        list_type = schema.get("x-kubernetes-list-type")
        if list_type == "set" or schema.get("uniqueItems"):
            seen = []
            for i, item in enumerate(value):
                if item in seen:
                    errs.append((path + [i], f"duplicate entry {item!r} in a set"))
                seen.append(item)
        elif list_type == "map" and isinstance(items, dict):
            keys = schema.get("x-kubernetes-list-map-keys", [])
            props = items.get("properties", {})
            seen = {}
            for i, item in enumerate(value):
                if not isinstance(item, dict):
                    continue
                key = tuple(item.get(k, props.get(k, {}).get("default")) for k in keys)
                if key in seen:
                    errs.append((path + [i], f"duplicate entry for key {dict(zip(keys, key))} "
                                             f"(first at index {seen[key]})"))
                seen.setdefault(key, i)

    def check_object(self, value, schema, path, errs, strict):
        n = len(value)
        if "minProperties" in schema and n < schema["minProperties"]:
            errs.append((path, f"has {n} properties, fewer than {schema['minProperties']}"))
        if "maxProperties" in schema and n > schema["maxProperties"]:
            errs.append((path, f"has {n} properties, more than {schema['maxProperties']}"))
        props = schema.get("properties", {})
        for name in schema.get("required", ()):
            if name not in value and "default" not in props.get(name, {}):
                errs.append((path, f"required field {name!r} is missing"))
        embedded = schema.get("x-kubernetes-embedded-resource")
        additional = schema.get("additionalProperties")
        for key, sub in value.items():
            where = path + [key]
            if key in props:
                self.check(sub, props[key], where, errs, strict)
            elif isinstance(additional, dict):
                self.check(sub, additional, where, errs, strict)
            elif embedded and key in ("apiVersion", "kind"):
                if not isinstance(sub, str):
                    errs.append((where, f"{sub!r} is not of type 'string'"))
            elif embedded and key == "metadata":
                check_object_meta(sub, where, errs)
            elif additional is False or (
                strict
                and additional is not True
                and not schema.get("x-kubernetes-preserve-unknown-fields")
                and (props or schema.get("type") == "object")
            ):
                errs.append((where, "unknown field (not in the schema)"))
        if path and path[-1] == "labels" and len(path) > 1 and path[-2] == "metadata":
            check_labels(value, path, errs)


def check_labels(labels, path, errs):
    for key, val in labels.items():
        prefix, _, name = str(key).rpartition("/")
        if (prefix and (len(prefix) > 253 or not DNS_SUBDOMAIN.match(prefix))) or (
            len(name) > 63 or not LABEL_NAME.match(name)
        ):
            errs.append((path + [key], f"{key!r} is not a valid label key"))
        if not isinstance(val, str):
            errs.append((path + [key], f"label value {val!r} is not a string"))
        elif val and (len(val) > 63 or not LABEL_NAME.match(val)):
            errs.append((path + [key], f"{val!r} is not a valid label value"))


def check_object_meta(meta, path, errs, top=False):
    if not isinstance(meta, dict):
        errs.append((path, f"{meta!r} is not of type 'object'"))
        return
    for key in meta:
        if key not in OBJECT_META_KEYS:
            errs.append((path + [key], "unknown field (not in ObjectMeta)"))
    name = meta.get("name")
    if top and name is None and "generateName" not in meta:
        errs.append((path, "required field 'name' is missing"))
    if name is not None and (
        not isinstance(name, str) or len(name) > 253 or not DNS_SUBDOMAIN.match(name)
    ):
        errs.append((path + ["name"], f"{name!r} is not a DNS subdomain name"))
    for field in ("labels", "annotations"):
        m = meta.get(field)
        if m is None:
            continue
        if not isinstance(m, dict):
            errs.append((path + [field], f"{m!r} is not of type 'object'"))
        elif field == "labels":
            check_labels(m, path + [field], errs)
        else:
            for k, v in m.items():
                if not isinstance(v, str):
                    errs.append((path + [field, k], f"annotation value {v!r} is not a string"))


def schemas_of(crd_files):
    schemas = {}
    for f in crd_files:
        for crd in load_all(f):
            if crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for v in crd["spec"]["versions"]:
                if v.get("served", True):
                    schemas[(f"{group}/{v['name']}", kind)] = v["schema"]["openAPIV3Schema"]
    return schemas


def check_document(doc, schema, checker):
    errs = []
    if not isinstance(doc, dict):
        return [([], "a manifest document must be a mapping")]
    body = {k: v for k, v in doc.items() if k != "metadata"}
    root = dict(schema)
    root["properties"] = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
    root["required"] = [r for r in schema.get("required", ()) if r != "metadata"]
    checker.check(body, root, [], errs)
    meta = doc.get("metadata")
    check_object_meta(meta, ["metadata"], errs, top=True)
    meta_schema = schema.get("properties", {}).get("metadata", {})
    if isinstance(meta, dict) and meta_schema.get("properties"):
        # A CRD may constrain its objects' names (a shorter maxLength, a pattern).
        checker.check(meta, meta_schema, ["metadata"], errs, strict=False)
    return errs


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--crd", action="append", required=True, help="a CRD YAML file")
    ap.add_argument("manifests", nargs="+")
    args = ap.parse_args(argv)
    try:
        schemas = schemas_of(args.crd)
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        print(f"ERROR reading the CRDs: {e}")
        return 2
    checker = Checker()
    failed, checked = False, 0
    for path in args.manifests:
        try:
            docs = load_all(path, StrictLoader)
        except (OSError, yaml.YAMLError) as e:
            print(f"ERROR {path}: {e}")
            failed = True
            continue
        for doc in docs:
            api = doc.get("apiVersion", "") if isinstance(doc, dict) else ""
            kind = doc.get("kind", "") if isinstance(doc, dict) else ""
            meta = doc.get("metadata") if isinstance(doc, dict) else None
            name = meta.get("name", "?") if isinstance(meta, dict) else "?"
            what = f"{path} {api} {kind}/{name}"
            group = api.rpartition("/")[0] if "/" in api else ""
            if (api, kind) in schemas:
                errs = check_document(doc, schemas[(api, kind)], checker)
                checked += 1
                if errs:
                    failed = True
                    for p, msg in errs:
                        print(f"ERROR {what}: {fmt_path(p)}: {msg}")
                else:
                    print(f"ok {what}")
            elif group in BUILTIN_GROUPS and api:
                print(f"builtin {what}")
            else:
                print(f"ERROR {what}: no CRD given for {kind} in {api or 'no apiVersion'}")
                failed = True
    print(f"crdcheck: {checked} custom resources checked; {checker.cel_rules} CEL rules on "
          "their fields not evaluated")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
