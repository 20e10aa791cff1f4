"""What `tandem submit` uploads, copied into a staging directory that is what Ray zips: what is listed is, byte for byte
and name for name, what arrives on the cluster.

By default an allow list: the job file, the files its fields name (data, eval data, a local model directory, the files
of rewards, tools, environment and data.map), the modules and package folders those import from inside the working
directory, and what `--include PATH` adds. Nothing else, whatever its name. With `--working-dir DIR` spelled out,
every file under DIR that Ray's packaging rules keep (its default excludes, .gitignore, .rayignore), less each one
that looks like a credential by its name or by its content (detect-secrets, Yelp's maintained scanner, and the rules
below; UTF-16 and UTF-32 text decoded first). Each file held back is named with its reason; `--allow PATH` sends one
anyway."""

from __future__ import annotations

import ast
import codecs
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tandem.core.config import JobConfigError

# gitwildmatch patterns (.gitignore syntax) of credential files and folders, anywhere in the tree
CREDENTIAL_NAMES = {
    "SSH key or SSH configuration": ["id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", "**/.ssh/", "known_hosts",
                                     "authorized_keys"],
    "key or certificate file": ["*.key", "*.pem", "*.p12", "*.pfx", "*.jks", "*.keystore"],
    "cloud credentials": ["**/.aws/", "**/.config/gcloud/", "**/.azure/", "**/.kube/config", "kubeconfig",
                          "application_default_credentials.json", "**/.docker/config.json", ".dockercfg"],
    "credentials file": [".netrc", "_netrc", ".pypirc", ".npmrc", ".git-credentials", ".htpasswd", "**/.ray/auth_token",
                         "credentials.json", "credentials", ".pgpass", ".vault-token", "rclone.conf",
                         "kaggle.json", "**/huggingface/token", "**/huggingface/stored_tokens", "**/.huggingface/"],
    "environment file": [".env", ".env.*", ".envrc"],
    "repository history": [".git"],
}
# detect-secrets' plugins, less those that flag what is no credential: any long random-looking string (data,
# hashes, tokenizer files: its two entropy plugins) and public IP addresses
NOT_SCANNED_FOR = {"Base64HighEntropyString", "HexHighEntropyString", "IPPublicDetector"}
# what detect-secrets has no plugin for
CREDENTIAL_CONTENT = {
    "Hugging Face token": re.compile(r"\bhf_[A-Za-z0-9]{30,}\b"),
    "private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    "docker registry auth": re.compile(r'"auth"\s*:\s*"[A-Za-z0-9+/=]{8,}"'),
    "a secret assigned": re.compile(
        r"(?im)^\s*(?:export\s+)?\w*(?:TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIALS?)\s*[:=]\s*"
        r"""(?:"[^"\s]{8,}"|'[^'\s]{8,}'|[^\s"'$()\[\]{}]{8,}(?=\s|$|;|#))"""),
}
SCAN_LIMIT = 4 << 20  # bytes: larger files (datasets, weights) are sent unscanned, and the list says so


@dataclass
class UploadPlan:
    root: Path
    sent: list[tuple[str, int]] = field(default_factory=list)  # (relative path, bytes)
    why: dict[str, str] = field(default_factory=dict)  # allow list: relative path -> the field that names it
    held: list[tuple[str, str]] = field(default_factory=list)  # (relative path, why)
    unscanned: list[tuple[str, str]] = field(default_factory=list)  # sent without a content scan, and why
    elsewhere: list[tuple[str, str]] = field(default_factory=list)  # named, outside the directory: not sent
    allow_list: bool = True

    def lines(self) -> list[str]:
        mb = sum(n for _, n in self.sent) / 1e6
        head = "what the job names" if self.allow_list else "the whole directory"
        out = [f"uploading {head} from {self.root}: {len(self.sent)} files, {mb:.1f} MB"]
        out += [f"  + {_shown(p)}" + (f" ({self.why[p]})" if p in self.why else "") for p, _ in self.sent]
        if self.allow_list:
            out.append("nothing else is sent: add a file with --include PATH, or send the whole directory "
                       "(scanned for credentials) with --working-dir DIR")
        if self.elsewhere:
            out.append("named by the job but outside the uploaded directory (must exist on every node, or be Hub ids):")
            out += [f"  = {p} ({why})" for p, why in self.elsewhere]
        if self.held:
            out.append(f"held back ({len(self.held)}; send one anyway with --allow PATH):")
            out += [f"  - {_shown(p)}: {why}" for p, why in self.held]
        if self.unscanned:
            out.append("not scanned for secrets: " + ", ".join(f"{p} ({why})" for p, why in self.unscanned))
        return out

    def stage(self) -> str:
        """A new directory holding exactly the files sent (hard links where the filesystem allows); the caller
        removes it once Ray has taken it."""
        stage = Path(tempfile.mkdtemp(prefix="tandem-upload-"))
        for rel, _ in self.sent:
            dst = stage / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(self.root / rel, dst)
            except OSError:
                shutil.copy2(self.root / rel, dst)
        return str(stage)


def _shown(rel: str) -> str:
    """A path as the list prints it: quoted where spaces at its ends or odd characters would hide what it is."""
    return repr(rel) if rel != rel.strip() or not rel.isprintable() else rel


# ----------------------------------------------------------------------------------------------- the allow list

def plan_job_upload(job: str, cfg, include: list[str] = (), allow: list[str] = ()) -> UploadPlan:
    """The files of the job `cfg` (read from `job`, relative paths against the working directory, which becomes the
    job's on the cluster), the modules they import from there, and `include`: each text file scanned as the
    whole-directory mode scans (a credential by its name or content refuses the upload, naming the file, unless
    `allow` names it: the job needs every file it names, so none is held back silently)."""
    root = Path.cwd().absolute()
    plan = UploadPlan(root)
    named: dict[str, str] = {}

    def add(path: str | None, why: str, must: bool = False) -> None:
        if path is None:
            return
        p = (root / path) if not Path(path).is_absolute() else Path(path)
        if not p.exists():
            if must:
                raise JobConfigError(f"--include {path!r}: no such file or folder under {str(root)!r}")
            plan.elsewhere.append((str(path), why))  # a Hub id, or a path the cluster has
            return
        try:
            rel = p.resolve().relative_to(root.resolve())
        except ValueError:
            plan.elsewhere.append((str(path), why))
            return
        files = [rel] if p.is_file() else sorted(f.relative_to(root.resolve()) for f in p.resolve().rglob("*")
                                                 if f.is_file() and "__pycache__" not in f.parts)
        for f in files:
            named.setdefault(str(f), why)

    add(job, "the job file")
    add(cfg.model.path, "model.path")
    add(cfg.data.path, "data.path")
    add(cfg.eval.path, "eval.path")
    for section, specs in (("rewards", cfg.rewards), ("tools", cfg.tools or []),
                           ("environment", [cfg.environment] if cfg.environment else []),
                           ("data.map", [cfg.data.map] if cfg.data.map else [])):
        for spec in specs:
            for f in module_files(root, spec.rpartition(":")[0]):
                add(str(f), section)
    for path in include:
        add(path, "--include", must=True)
    for rel in list(named):  # the modules they import from the working directory, and theirs
        if rel.endswith(".py"):
            for f in local_imports(root, root / rel, seen=set(named)):
                named.setdefault(str(f.relative_to(root)), f"imported by {rel}")
    refuse_credentials(root, named, [_relative(root, a) for a in allow])
    for rel, why in named.items():
        plan.sent.append((rel, (root / rel).stat().st_size))
        plan.why[rel] = why
    return plan


def refuse_credentials(root: Path, named: dict[str, str], allowed: list[str]) -> None:
    """Raises naming the first file (relative path -> why it is sent) that looks like a credential by its name or its
    content (as the whole-directory mode scans), unless `allowed` (relative paths or folders) holds it."""
    credential = _name_rules()
    for rel, why in named.items():
        if any(rel == a or rel.startswith(a.rstrip("/") + "/") for a in allowed):
            continue
        text = read_text(root / rel) if (root / rel).stat().st_size <= SCAN_LIMIT else None
        if found := credential(rel) or (secrets_in(text) if text is not None else None):
            raise JobConfigError(f"{rel} ({why}): looks like a credential ({found}); not uploaded; allowed: keep "
                                 "the secret in the cluster's environment (a variable the code reads), or send "
                                 f"the file anyway with --allow {rel}")


def module_files(root: Path, target: str) -> list[Path]:
    """A function spec's file ('dir/file.py') or module ('pkg.mod': pkg/mod.py or pkg/mod/__init__.py, with the
    packages' __init__.py) under root; [] where it is neither (an installed module)."""
    if target.endswith((".py", ".pkl")):
        return [Path(target)]
    parts = target.split(".")
    for cand in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
        if cand.is_file():
            inits = [root.joinpath(*parts[:k], "__init__.py") for k in range(1, len(parts))]
            return [p.relative_to(root) for p in inits if p.is_file()] + [cand.relative_to(root)]
    return []


def local_imports(root: Path, path: Path, seen: set) -> list[Path]:
    """Files under root that `path` imports (a module file, or every .py of a package folder), transitively."""
    out, todo = [], [path]
    while todo:
        try:
            tree = ast.parse(todo.pop().read_bytes())
        except (SyntaxError, OSError, ValueError):
            continue
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        for name in names:
            top = root / name.split(".")[0]
            files = [top.with_suffix(".py")] if top.with_suffix(".py").is_file() else (
                sorted(f for f in top.rglob("*.py") if "__pycache__" not in f.parts) if top.is_dir() else [])
            for f in files:
                rel = str(f.relative_to(root))
                if rel not in seen:
                    seen.add(rel)
                    out.append(f)
                    todo.append(f)
    return out


# --------------------------------------------------------------------------------------- the whole directory

def plan_upload(working_dir: str, allow: list[str] = ()) -> UploadPlan:
    """The files `tandem submit --working-dir` would send from working_dir and those it holds back. allow: paths
    (relative to working_dir as the list prints them, or absolute; a folder allows what is under it) sent whatever
    their name or content."""
    root = Path(working_dir).absolute()
    allowed = [_relative(root, a) for a in allow]
    credential = _name_rules()
    plan = UploadPlan(Path(working_dir), allow_list=False)
    for rel, size in ray_walk(root):
        if any(rel == a or rel.startswith(a.rstrip("/") + "/") for a in allowed):
            plan.sent.append((rel, size))
        elif why := credential(rel):
            plan.held.append((rel, f"{why} (by its name)"))
        elif size > SCAN_LIMIT:
            plan.sent.append((rel, size))
            plan.unscanned.append((rel, f"over {SCAN_LIMIT >> 20} MiB"))
        else:
            text = read_text(root / rel)
            if text is None:
                plan.sent.append((rel, size))
                plan.unscanned.append((rel, "binary"))
            elif found := secrets_in(text):
                plan.held.append((rel, f"looks like it holds a secret: {found}"))
            else:
                plan.sent.append((rel, size))
    matched = {a for a in allowed for rel, _ in plan.sent if rel == a or rel.startswith(a.rstrip("/") + "/")}
    if unmatched := [path for path, a in zip(allow, allowed) if a not in matched]:
        raise JobConfigError(f"--allow {unmatched[0]!r}: matches no file of the upload from {str(root)!r} (ignored by "
                             ".gitignore or .rayignore, or not there); allowed: a path as the upload list prints it, "
                             "or a folder holding some of them")
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


_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def read_text(path: Path) -> str | None:
    """A file's text (UTF-8, or UTF-16/32 by their byte-order mark or their zero bytes), None for a binary."""
    data = path.read_bytes()
    encodings = [enc for bom, enc in _BOMS if data.startswith(bom)]
    if not encodings and b"\0" in data[:8192]:  # UTF-16/32 without a mark: every other (or 3 of 4) bytes zero
        encodings = ["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"]
    for enc in encodings or ["utf-8"]:
        try:
            text = data.decode(enc)
        except UnicodeDecodeError:
            continue
        if "\0" not in text and sum(c.isprintable() or c.isspace() for c in text[:4096]) >= 0.95 * len(text[:4096]):
            return text
    return None if encodings or b"\0" in data[:8192] else data.decode("utf-8", errors="replace")


def secrets_in(text: str) -> str | None:
    """What detect-secrets and CREDENTIAL_CONTENT find in a text ('AWS Access Key on line 3, ...'), or None."""
    from detect_secrets import SecretsCollection
    from detect_secrets.settings import default_settings, transient_settings

    hits = {(text.count("\n", 0, m.start()) + 1, why) for why, rx in CREDENTIAL_CONTENT.items()
            for m in rx.finditer(text)}
    with default_settings() as s:
        plugins = [p for p in s.json()["plugins_used"] if p["name"] not in NOT_SCANNED_FOR]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8", delete=False) as f:
        f.write(text)  # detect-secrets reads files: the decoded text, under a plain name
    try:
        found = SecretsCollection()
        with transient_settings({"plugins_used": plugins}):
            found.scan_file(f.name)
        hits |= {(s.line_number, s.type) for _, s in found}
    finally:
        os.unlink(f.name)
    return ", ".join(f"{t} on line {n}" for n, t in sorted(hits)) or None
