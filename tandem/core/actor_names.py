"""The names Tandem's Ray actors carry, so that the Ray dashboard (and `ray list actors`) says which run each
belongs to and which worker or rank it is: `rollout-<slot>` and `learner-<rank>`, then `#<n>` (the n-th actor this
controller started, so that a replacement never waits for its predecessor's name to be freed), then the run
directory as the job file names it (the controller's own name is `controller:<run directory>`)."""

from __future__ import annotations

import itertools

_STARTED = itertools.count()


def actor_name(role: str, index: int, output_dir: str) -> str:
    return f"{role}-{index}#{next(_STARTED)} {output_dir}"


def node_line(host: str, ip: str, node_id: str) -> str:
    """A node as Tandem's lines name it: host (address, Ray node id's first 12 hex digits)."""
    return f"{host} ({ip}, Ray node {node_id[:12]})"


def death_cause(error) -> str:
    """A Ray actor's death in a few words, from Ray's exception and message (the learner's and a rollout worker's
    lines say it)."""
    text = str(error)
    low = text.lower()
    if type(error).__name__ in ("ActorUnavailableError", "GetTimeoutError") or "is unavailable" in low:
        return "unreachable: its node or process does not answer"
    if any(s in low for s in ("node has died", "node died", "node is dead", "node was terminated")):
        return "its node died"
    if any(s in low for s in ("process has died", "killed", "sigkill", "exited", "died unexpectedly")):
        return "its process died"
    return text.strip().splitlines()[0][:80] if text.strip() else type(error).__name__
