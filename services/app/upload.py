"""What `tandem submit` uploads: the working directory walked with Ray's own packaging rules (its default
excludes, .gitignore and .rayignore), less every file that looks like a credential, by its name or by its
content (detect-secrets, Yelp's maintained scanner). Each file held back is named with its reason; `--allow
PATH` sends one anyway. The held files reach Ray as exact excludes, so what is listed is what Ray zips."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from tandem.core.config import JobConfigError

# gitwildmatch patterns (.gitignore syntax) of credential files and folders, anywhere in the tree
CREDENTIAL_NAMES = {
    "SSH key or SSH configuration": ["id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", "**/.ssh/", "known_hosts",
                                     "authorized_keys"],
    "key or certificate file": ["*.key", "*.pem", "*.p12", "*.pfx", "*.jks", "*.keystore"],
    "cloud credentials": ["**/.aws/", "**/.config/gcloud/", "**/.azure/", "**/.kube/config", "kubeconfig",
                          "application_default_credentials.json", "**/.docker/config.json"],
    "credentials file": [".netrc", "_netrc", ".pypirc", ".npmrc", ".git-credentials", ".htpasswd", "**/.ray/auth_token"],
    "environment file": [".env", ".env.*", ".envrc"],
    "repository history": [".git"],
}
# detect-secrets' plugins, less those that flag what is no credential: any long random-looking string (data,
# hashes, tokenizer files: its two entropy plugins) and public IP addresses
NOT_SCANNED_FOR = {"Base64HighEntropyString", "HexHighEntropyString", "IPPublicDetector"}
SCAN_LIMIT = 4 << 20  # bytes: larger files (datasets, weights) are sent unscanned, and the list says so


@dataclass
class UploadPlan:
    root: Path
    sent: list[tuple[str, int]] = field(default_factory=list)  # (relative path, bytes)
    held: list[tuple[str, str]] = field(default_factory=list)  # (relative path, why)
    unscanned: list[str] = field(default_factory=list)  # sent without a content scan (too large)

    def excludes(self) -> list[str]:
        """The held files as Ray runtime_env excludes: anchored, glob characters escaped."""
        return ["/" + re.sub(r"([\[\]*?!#\\])", r"\\\1", p) for p, _ in self.held]

    def lines(self) -> list[str]:
        mb = sum(n for _, n in self.sent) / 1e6
        out = [f"uploading {self.root}: {len(self.sent)} files, {mb:.1f} MB ({', '.join(p for p, _ in self.sent)})"]
        if self.held:
            out.append(f"held back ({len(self.held)}; send one anyway with --allow PATH):")
            out += [f"  {p}: {why}" for p, why in self.held]
        if self.unscanned:
            out.append(f"not scanned for secrets (over {SCAN_LIMIT >> 20} MiB): {', '.join(self.unscanned)}")
        out.append("excluded as Ray's defaults, .gitignore and .rayignore say")
        return out


def plan_upload(working_dir: str, allow: list[str] = ()) -> UploadPlan:
    """The files `tandem submit` would send from working_dir and those it holds back. allow: paths (relative to
    working_dir as the list prints them, or absolute; a folder allows what is under it) sent whatever their name or content."""
    root = Path(working_dir).absolute()
    allowed = [_relative(root, a) for a in allow]
    credential = _name_rules()
    plan = UploadPlan(Path(working_dir))
    for rel, size in ray_walk(root):
        if any(rel == a or rel.startswith(a.rstrip("/") + "/") for a in allowed):
            plan.sent.append((rel, size))
        elif why := credential(rel):
            plan.held.append((rel, f"{why} (by its name)"))
        elif size > SCAN_LIMIT:
            plan.sent.append((rel, size))
            plan.unscanned.append(rel)
        elif found := secrets_in(root / rel):
            plan.held.append((rel, f"looks like it holds a secret: {found} (detect-secrets)"))
        else:
            plan.sent.append((rel, size))
    return plan


def _relative(root: Path, path: str) -> str:
    """An --allow path as the printed list shows it (relative to the uploaded directory), or absolute."""
    p = Path(path) if Path(path).is_absolute() else root / path
    try:
        return str(p.resolve().relative_to(root.resolve()))
    except ValueError:
        raise JobConfigError(f"--allow {path!r}: not inside the uploaded directory {str(root)!r}; allowed: a path as "
                         "the upload list prints it, or an absolute path under that directory") from None


def _name_rules():
    from ray._private.thirdparty.pathspec import PathSpec

    specs = {why: PathSpec.from_lines("gitwildmatch", pats) for why, pats in CREDENTIAL_NAMES.items()}
    return lambda rel: next((why for why, s in specs.items() if s.match_file(rel)), None)


def ray_walk(root: Path) -> list[tuple[str, int]]:
    """(relative path, bytes) of each file Ray would zip from root, with no excludes of ours."""
    from ray._private import ray_constants
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    files = []

    def add(p: Path) -> None:
        if p.is_file():
            files.append((str(p.relative_to(root)), p.stat().st_size))
    quiet = logging.getLogger("tandem.upload")  # Ray's walker logs each ignore file it reads
    quiet.setLevel(logging.WARNING)
    _dir_travel(root, [_get_excludes(root, ray_constants.get_runtime_env_default_excludes())], add,
                include_gitignore=os.environ.get(ray_constants.RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1",
                logger=quiet)
    return sorted(files)


def secrets_in(path: Path) -> str | None:
    """What detect-secrets finds in a text file ('AWS Access Key on line 3, ...'), or None (also for binaries)."""
    with open(path, "rb") as f:
        if b"\0" in f.read(8192):
            return None
    from detect_secrets import SecretsCollection
    from detect_secrets.settings import default_settings, transient_settings

    with default_settings() as s:
        plugins = [p for p in s.json()["plugins_used"] if p["name"] not in NOT_SCANNED_FOR]
    found = SecretsCollection()
    with transient_settings({"plugins_used": plugins}):
        found.scan_file(str(path))
    hits = sorted({(s.line_number, s.type) for _, s in found})
    return ", ".join(f"{t} on line {n}" for n, t in hits) or None
