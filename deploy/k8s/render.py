#!/usr/bin/env python3
"""Render a kustomization without kubectl, for the subset these manifests use:
resources (files and directories), configMapGenerator (literals; behavior create or merge),
images (newName/newTag), replicas, and patches (strategic merge: maps merge, lists of named
items merge by name, other lists are replaced; target by kind and name, or the patch's own).

    python deploy/k8s/render.py deploy/k8s/overlays/tcp > tcp.yaml
"""

import copy
import sys
from pathlib import Path

import yaml


def _merge(base, patch):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and patch
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = [copy.deepcopy(x) for x in base]
        index = {x["name"]: i for i, x in enumerate(out)}
        for item in patch:
            if item["name"] in index:
                out[index[item["name"]]] = _merge(out[index[item["name"]]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _configmap(gen: dict) -> dict:
    data = dict(lit.split("=", 1) for lit in gen.get("literals", []))
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data}


def render(path: str | Path) -> list[dict]:
    root = Path(path)
    kust = yaml.safe_load((root / "kustomization.yaml").read_text())
    objects: list[dict] = []
    for res in kust.get("resources", []):
        target = root / res
        if target.is_dir():
            objects += render(target)
        else:
            objects += [d for d in yaml.safe_load_all(target.read_text()) if d]
    for gen in kust.get("configMapGenerator", []):
        cm = _configmap(gen)
        existing = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == gen["name"]]
        if gen.get("behavior", "create") == "merge":
            if not existing:
                raise ValueError(f"{root}: configMapGenerator merge into missing {gen['name']}")
            existing[0]["data"].update(cm["data"])
        elif existing:
            raise ValueError(f"{root}: ConfigMap {gen['name']} generated twice")
        else:
            objects.append(cm)
    for patch_ref in kust.get("patches", []):
        patch = yaml.safe_load((root / patch_ref["path"]).read_text())
        target = patch_ref.get("target") or {"kind": patch["kind"], "name": patch["metadata"]["name"]}
        hits = [i for i, o in enumerate(objects)
                if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        if not hits:
            raise ValueError(f"{root}: patch {patch_ref['path']} matches no {target['kind']}/{target['name']}")
        body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind", "metadata")}
        for i in hits:
            objects[i] = _merge(objects[i], body)
    for rep in kust.get("replicas", []):
        for o in objects:
            if o["metadata"]["name"] == rep["name"] and "replicas" in o.get("spec", {}):
                o["spec"]["replicas"] = rep["count"]
    for img in kust.get("images", []):
        for o in objects:
            for c in o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                name, _, tag = c["image"].partition(":")
                if name == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag or 'latest')}"
    return objects


if __name__ == "__main__":
    yaml.safe_dump_all(render(sys.argv[1]), sys.stdout, sort_keys=False)
