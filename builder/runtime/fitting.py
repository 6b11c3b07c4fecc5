"""Which published tag of an image fits a host: the advice the guard (and TensorRT's own errors) give
when an engine does not fit, so users pull the right tag instead of guessing."""
from __future__ import annotations

from .hostinfo import HostFacts

ENV_RECOMPILE = "MOPT_RECOMPILE_ON_MISMATCH"
ENV_CACHE = "MOPT_ENGINE_CACHE"


def sm_label(sm: str | None, name: str | None) -> str:
    return f"sm_{sm} ({name})" if name else f"sm_{sm}"


def fitting_tag(image: dict | None, facts: HostFacts) -> str:
    """Advice naming the published tag that fits this host, or saying plainly that none does."""
    if not image or not image.get("repository"):
        return ("no image info in engine.json to name a fitting tag; recompile on this host "
                f"(compile) or set {ENV_RECOMPILE}=1 and {ENV_CACHE}=/path")
    repo, by_sm = image["repository"], image.get("tags_by_sm") or {}
    key = facts.sm or "cpu"
    host = f"sm_{facts.sm}" if facts.sm else "a host without a CUDA GPU"
    if key in by_sm:
        return f"pull {repo}:{by_sm[key]}"
    if by_sm:
        published = ", ".join(f"sm_{k}" if k != "cpu" else "cpu" for k in sorted(by_sm))
        return f"no published tag of {repo} fits {host} (published: {published})"
    template = image.get("tag_template")
    if template and facts.sm and facts.cuda:
        try:
            tag = template.format(cuda=facts.cuda.replace(".", ""), sm=facts.sm)
        except (KeyError, IndexError, ValueError):
            tag = None
        if tag:
            return f"no list of published tags; the tag for this host would be {repo}:{tag} if it exists"
    return f"no published tag of {repo} is known to fit {host}"
