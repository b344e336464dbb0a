"""What `disagg bench` can learn of the deployment behind a router it did not start: the
router's /ready lists each pair's worker URLs, and each worker's /health names its preset.
Best effort: the bench runs whatever these say, and a plot titled "preset unknown" is better
than a bench that fails on a worker it cannot reach."""

import json
import re
import urllib.error
import urllib.request

TIMEOUT_S = 5.0
PRESET = re.compile(r"[\w.-]{1,64}")  # what a preset name looks like; anything else is not shown


def get_json(url: str, timeout: float = TIMEOUT_S) -> dict | None:
    """GET a JSON object, the body of an error status included (a 503 /ready still lists the
    pairs); None for anything else (unreachable, not a JSON object)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read())
        except (OSError, ValueError):
            return None
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def worker_urls(router: str) -> list[str]:
    """Every worker URL the router's /ready names (pairs' `prefill` and `decode`, ranks joined
    by +), in order, once each."""
    body = get_json(router.rstrip("/") + "/ready") or {}
    pairs = body.get("pairs")
    urls: list[str] = []
    for pair in pairs if isinstance(pairs, list) else []:
        for side in ("prefill", "decode"):
            value = pair.get(side) if isinstance(pair, dict) else None
            for url in value.split("+") if isinstance(value, str) else []:
                if url.startswith(("http://", "https://")) and url not in urls:
                    urls.append(url)
    return urls


def router_workers(router: str) -> dict[str, dict]:
    """Each worker URL the router's /ready names -> its /health ({} where it gave none)."""
    return {url: get_json(url.rstrip("/") + "/health") or {} for url in worker_urls(router)}


def router_preset(router: str) -> str | None:
    """The preset the router's workers report (several joined by +), or None if none said."""
    presets: list[str] = []
    for health in router_workers(router).values():
        preset = health.get("preset")
        if isinstance(preset, str) and PRESET.fullmatch(preset) and preset not in presets:
            presets.append(preset)
    return "+".join(presets) or None
