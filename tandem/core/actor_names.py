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
