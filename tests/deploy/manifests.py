"""Reading the Kubernetes manifests of deploy/k8s as a cluster would run them: a container's environment as the kubelet
builds it, its command after Kubernetes' $(VAR) expansion (and the shell's, for `sh -c`), parsed by the service's own
argument parser; and the schemas every document is validated against."""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
LWS_CRD = Path(__file__).resolve().parent / "schemas" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
OLDEST_KUBERNETES = "1.26"  # the oldest LWS supports (its installation guide)

_PARSERS = {"services.worker": "services.worker.__main__", "services.router": "services.router.__main__",
            "services.controller": "services.controller.__main__", "services.front": "services.front.__main__"}


def load_documents(path: Path) -> dict[str, dict]:
    """The manifest's documents by KIND/NAME."""
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in documents}


def parse(command: list[str], mounts: Mapping[str, Path] | None = None) -> argparse.Namespace:
    """The container's `python -m services.X ...` parsed by services.X's own parser (SystemExit on a bad flag).
    mounts: a container path (a volume's mountPath) -> the local directory standing in for it, for the parsers that
    open what they are given (the weight store checks its TLS files)."""
    assert command[:2] == ["python", "-m"], command
    module, argv = command[2], [_local(str(a), mounts or {}) for a in command[3:]]
    if module == "services.weightstore":
        from services.weightstore.__main__ import parse_args

        return parse_args(argv)
    build_parser = __import__(_PARSERS[module], fromlist=["build_parser"]).build_parser
    return build_parser().parse_args(argv)


def _local(argument: str, mounts: Mapping[str, Path]) -> str:
    for mount, local in mounts.items():
        if argument == mount or argument.startswith(mount.rstrip("/") + "/"):
            return str(local / os.path.relpath(argument, mount))
    return argument


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion (k8s.io/kubernetes third_party/forked/golang/expansion): $(NAME) of a defined
    variable is its value, $$ is a literal $, anything else (an undefined name, the shell's $VAR or $((...))) is
    left as it is."""
    out, cursor = [], 0
    while cursor < len(text):
        if text[cursor] != "$" or cursor + 1 == len(text):
            out.append(text[cursor])
            cursor += 1
            continue
        following = text[cursor + 1]
        if following == "$":
            out.append("$")
            cursor += 2
        elif following == "(" and (close := text.find(")", cursor + 2)) != -1:
            name = text[cursor + 2:close]
            out.append(env[name] if name in env else f"$({name})")
            cursor = close + 1
        else:
            out.append("$" + following)
            cursor += 2
    return "".join(out)


def container_env(container: dict, injected: Mapping[str, str], fields: Mapping[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: `injected` first (what a controller's webhook prepends,
    e.g. LWS's variables), then its `env` in order, each value expanded against the variables defined before it;
    fields: the pod's downward-API fields (metadata.name, ...)."""
    env = dict(injected)
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = expand(str(variable["value"]), env)
        else:
            env[variable["name"]] = fields[variable["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def argv(container: dict, env: Mapping[str, str]) -> list[str]:
    """The program and arguments the container runs: command + args after Kubernetes' expansion; a `sh -c SCRIPT`
    is run by a real sh with `env`, its `exec python ...` caught by a stand-in that prints its arguments."""
    words = [expand(str(word), env) for word in [*container["command"], *container.get("args", [])]]
    if words[:2] != ["sh", "-c"]:
        return words
    return _shell_argv(words[2], env)


def _shell_argv(script: str, env: Mapping[str, str]) -> list[str]:
    shell = shutil.which("sh")
    assert shell, "no sh on PATH"
    with tempfile.TemporaryDirectory() as bin_dir:
        stand_in = Path(bin_dir) / "python"
        stand_in.write_text(f"#!{shell}\nprintf '%s\\0' python \"$@\"\n")
        stand_in.chmod(0o755)
        # The container's environment only, and a PATH on which `python` is the stand-in.
        result = subprocess.run([shell, "-c", script], env={**env, "PATH": bin_dir}, capture_output=True,
                                timeout=30, check=True)
    printed = result.stdout.decode().split("\0")
    assert printed[-1] == "" and printed[0] == "python", f"{script!r} ran no `python`: {result.stdout!r}"
    return printed[:-1]


# Schemas.

@functools.cache
def lws_schema() -> dict:
    """The LeaderWorkerSet CRD's openAPIV3Schema (v1), made strict as `kubectl apply` (field validation Strict)
    treats a custom resource: an unknown field is an error, not pruned."""
    crd = yaml.load(LWS_CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1" and v["served"])
    return _strict(version["schema"]["openAPIV3Schema"])


def _strict(schema: dict) -> dict:
    """`schema` with additionalProperties: false on every object schema that lists its properties and neither
    says what else it admits nor preserves unknown fields (x-kubernetes-preserve-unknown-fields)."""
    strict = dict(schema)
    if "properties" in strict:
        strict["properties"] = {name: _strict(s) for name, s in strict["properties"].items()}
        if "additionalProperties" not in strict and not strict.get("x-kubernetes-preserve-unknown-fields"):
            strict["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(strict.get(key), dict):
            strict[key] = _strict(strict[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in strict:
            strict[key] = [_strict(s) for s in strict[key]]
    return strict


def kubernetes_versions() -> tuple[str, str]:
    """The Kubernetes versions the documents are validated for: the oldest LWS supports, the newest known."""
    import kubernetes_validate

    return OLDEST_KUBERNETES, kubernetes_validate.latest_version()


def validate(document: dict, kubernetes_version: str) -> None:
    """Raise (jsonschema.ValidationError, kubernetes_validate's errors) unless `document` is valid: a LeaderWorkerSet
    against its CRD's schema (and its pod templates as PodTemplates of that Kubernetes version), any other kind
    against the Kubernetes schemas of that version; unknown fields are errors."""
    import jsonschema
    import kubernetes_validate

    if document["kind"] == "LeaderWorkerSet":
        assert document["apiVersion"] == "leaderworkerset.x-k8s.io/v1", document["apiVersion"]
        jsonschema.Draft4Validator(lws_schema()).validate(document)
        templates = document["spec"]["leaderWorkerTemplate"]
        for role in ("leaderTemplate", "workerTemplate"):
            if role in templates:
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                              "metadata": {"name": role.lower()}, "template": templates[role]},
                                             kubernetes_version, strict=True)
        return
    kubernetes_validate.validate(document, kubernetes_version, strict=True)
