"""Creating studies: parse and check the spec, clone the repository, set up trunk and root."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlmodel import Session, select

from agents import globs
from agents.policies import registry
from agents.spec import Level, Spec, SpecError, SpecIssue, format_key, parse_spec
from agents.speccheck import check_against_tree
from agents.tree.status import NodeStatus, StudyStatus
from backend.core import cloning, gitops, localmodel
from backend.core.config import Settings
from backend.core.errors import FieldError
from backend.core.models import Node, Study
from backend.services import lifecycle, memory
from backend.services.records import add_event, spec_of


class StudyExists(ValueError):
    """A study with this name already exists."""


def check_spec(
    spec: Spec, repo: gitops.Repo, source: str = "grove.toml", warnings: list[SpecIssue] | None = None
) -> str:
    """Check the spec against the repository at `base`; return the base commit or raise SpecError.

    Every problem is reported at once: with `base` missing, the files are checked at HEAD. Warnings
    (which do not stop a study) are appended to `warnings` when it is given.
    """
    issues: list[SpecIssue] = []
    try:
        base = at = repo.rev(spec.study.base)
    except gitops.GitError:
        base = ""
        branches = ", ".join(repo.branches()) or "none"
        issues.append(
            SpecIssue(
                key="study.base",
                message=f"{spec.study.base!r} is not a branch or commit of the repository "
                f"(its branches: {branches}); leave it out to use the repository's default branch",
            )
        )
        at = repo.rev("HEAD")
    issues += check_against_tree(spec, repo.files_at(at), lambda p: repo.read_followed(at, p))
    issues += _linked_targets(spec, repo, at)
    errors = [i for i in issues if i.level == Level.ERROR]
    if errors:
        raise SpecError(errors, source)
    if warnings is not None:
        warnings += issues
    return base


def _linked_targets(spec: Spec, repo: gitops.Repo, at: str) -> list[SpecIssue]:
    """Refuse a `[search]` file that is a link to a file a change may not edit (or a sealed one)."""
    out = []
    for key in spec.search:
        for file, _ in spec.targets(key):
            try:
                real = repo.resolve_at(at, file)
            except (ValueError, gitops.GitError):
                continue  # check_against_tree has named it
            if real == file:
                continue
            if globs.match_any(spec.files.sealed, real) or globs.match_any(spec.files.protected, real):
                why = "sealed" if globs.match_any(spec.files.sealed, real) else "protected"
            elif not globs.match_any(spec.files.editable, real):
                why = "not in files.editable"
            else:
                continue
            out.append(
                SpecIssue(
                    key=format_key(("search", key)), message=f"{file} is a link to {real}, which is {why}"
                )
            )
    return out


def base_values(spec: Spec, repo: gitops.Repo, base: str) -> dict[str, Any]:
    """Return the current value of each search key at the base commit."""
    return {key: spec.value_at(key, lambda f: repo.read_followed(base, f)) for key in spec.search}


def validate(
    spec_text: str,
    source_repo: str,
    source: str = "grove.toml",
    warnings: list[SpecIssue] | None = None,
    trial: Callable[[Spec, gitops.Repo, str], None] | None = None,
    settings: Settings | None = None,
) -> Spec:
    """Parse a spec and check it against a repository without creating anything.

    With `trial`, it is then called with the spec, the clone and the base commit (a dev run).
    """
    spec = parse_spec(spec_text, source)
    if settings is not None:
        check_operator_limits(settings, spec, source)
    if warnings is not None:
        warnings += uncommitted(source_repo)
    tmp = Path(tempfile.mkdtemp(prefix="grove-validate-")) / "repo"
    try:
        repo = gitops.clone(source_repo, tmp)
        base = check_spec(spec, repo, source, warnings)
        if trial is not None:
            trial(spec, repo, base)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)
    return spec


def uncommitted(source_repo: str) -> list[SpecIssue]:
    """Warn when a local repository's working tree differs from what Grove will study (its commits).

    Each tracked file's bytes are hashed here as git hashes a blob and compared with HEAD's tree:
    `git status` would run the repository's own clean filters, which Grove's git never does.
    """
    path = Path(source_repo).expanduser()
    if gitops.is_url(source_repo) or not path.is_dir() or gitops.toplevel(path.resolve()) != path.resolve():
        return []
    root = path.resolve()
    listing = gitops.git("ls-tree", "-r", "-z", "HEAD", cwd=root, check=False, foreign=True)
    changed = []
    for entry in listing.split("\0")[:5000]:
        meta, _, name = entry.partition("\t")
        parts = meta.split()
        if len(parts) != 3 or parts[1] != "blob" or name == "grove.toml":
            continue
        file = root / name
        try:
            if parts[0] == "120000":
                data = os.readlink(file).encode()
            elif file.is_symlink() or not file.is_file():
                changed.append(name)
                continue
            else:
                data = file.read_bytes()
        except OSError:
            changed.append(name)
            continue
        algo = hashlib.sha256 if len(parts[2]) == 64 else hashlib.sha1  # the repository's object format
        if algo(b"blob %d\0" % len(data) + data).hexdigest() != parts[2]:
            changed.append(name)
    if not changed:
        return []
    shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    return [
        SpecIssue(
            key="",
            level=Level.WARNING,
            message=f"the working tree differs from the last commit in {shown}: Grove studies the commit "
            "(values, the evaluator and the files all come from it); commit the changes to include them",
        )
    ]


def check_new(s: Session, spec: Spec, source_repo: str, allow_plain_folder: bool = False) -> None:
    """Refuse a new study whose source is not a repository or whose name is taken."""
    if not allow_plain_folder and not gitops.is_url(source_repo):
        path = Path(source_repo).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"{source_repo!r} does not exist or is not a directory")
        if gitops.toplevel(path.resolve()) != path.resolve():
            raise FileNotFoundError(
                f"{source_repo!r} is not the top of a git repository: the service tunes git repositories "
                "(make it one: git init && git add -A && git commit -m init), while `grove run` on this "
                "machine also imports a plain folder as a one-commit snapshot"
            )
    if s.exec(select(Study).where(Study.name == spec.study.name)).first():
        raise StudyExists(f"study {spec.study.name!r} already exists")


class SourceRefused(FieldError):
    """A repository source the server's settings do not allow over the API (`key`: the field, `repository`)."""


def check_source(settings: Settings, source: str) -> None:
    """Refuse a repository given over the API unless the operator's settings allow it.

    Local paths must lie under a `GROVE_REPO_ROOTS` folder (file: URLs are refused); URLs must use
    https, ssh or git, and name a host that resolves outside this server's network, or one that
    `GROVE_REPO_HOSTS` lists (only those when it is set: `backend.core.cloning`).
    """
    if not source.strip() or any(ord(c) < 32 or ord(c) == 127 for c in source):
        raise SourceRefused("repository", "must be a path or URL without control characters")
    if source.startswith("-"):
        raise SourceRefused("repository", "must not start with '-'")
    if source.lower().startswith("file:"):
        # git decodes %2F and reads a host part; a plain path is checked as it will be cloned.
        raise SourceRefused("repository", "file: URLs are not accepted over the API; give the folder's path")
    if not gitops.is_url(source):
        try:
            path = Path(source).expanduser().resolve()
        except RuntimeError:  # `~name` of a user this machine does not know
            raise SourceRefused(
                "repository", f"cannot expand {source.split('/', 1)[0]!r} on this server"
            ) from None
        _allowed_folder(settings, path)
        # What git reads is judged too: a gitfile, `commondir`, alternates or a linked pack may lead
        # from an allowed folder into another study's clone. Looked at only once the path itself
        # passed, so that a refusal says nothing about what lies outside the roots.
        try:
            folders = gitops.git_data_folders(path)
        except gitops.TooManyObjects as exc:
            raise SourceRefused("repository", f"{exc}; pack it first (git gc)") from None
        except (OSError, gitops.GitError) as exc:
            raise SourceRefused("repository", f"git cannot read {path}: {str(exc)[:300]}") from None
        for folder in folders:
            try:
                _allowed_folder(settings, folder)
            except SourceRefused as exc:
                raise SourceRefused(
                    "repository",
                    f"its git data is read from {folder} (through a gitfile, commondir, "
                    f"alternates or a link), which is not allowed: {exc.detail}",
                ) from None
        return
    try:
        cloning.check(settings, source)
    except cloning.HostRefused as exc:
        raise SourceRefused(exc.key, exc.detail) from None


def _allowed_folder(settings: Settings, path: Path) -> None:
    """Refuse a resolved local folder outside `GROVE_REPO_ROOTS` or inside Grove's own folders."""
    roots = [Path(r).expanduser().resolve() for r in settings.repo_roots.split(",") if r.strip()]
    if not any(path.is_relative_to(r) for r in roots):
        where = ", ".join(str(r) for r in roots) if roots else "no folder (GROVE_REPO_ROOTS is not set)"
        raise SourceRefused("repository", f"local paths over the API must lie under {where}")
    # Grove's own clones and worktrees hold other studies' histories, sealed files included; only
    # the snapshots `grove submit` makes of plain folders (its imports) may be given from there.
    data = settings.data_dir.expanduser().resolve()
    imported = path.is_relative_to(data / "imports") and path != data / "imports"
    for own in (data, settings.worktrees_dir.expanduser().resolve()):
        if path.is_relative_to(own) and not imported:
            raise SourceRefused("repository", f"{path} is inside Grove's own folder {own}; give the original")


def check_study(
    s: Session, spec_text: str, source_repo: str, warnings: list[SpecIssue] | None = None
) -> Spec:
    """Check everything `create_study` checks for a served study, creating nothing."""
    spec = parse_spec(spec_text, "grove.toml")
    check_new(s, spec, source_repo, allow_plain_folder=False)
    return validate(spec_text, source_repo, warnings=warnings)


def create_study(
    s: Session,
    settings: Settings,
    spec_text: str,
    source_repo: str,
    *,
    spec_source: str = "grove.toml",
    allow_plain_folder: bool = True,
) -> Study:
    """Create a study: check the spec, clone the repository, create trunk and the root node."""
    study = register_study(
        s, settings, spec_text, source_repo, allow_plain_folder=allow_plain_folder, spec_source=spec_source,
        announce=False,
    )  # fmt: skip
    return clone_study(s, settings, study, spec_source=spec_source)


def check_operator_limits(settings: Settings, spec: Spec, source: str = "grove.toml") -> None:
    """Refuse what a spec may ask for only with the operator's leave (network access)."""
    issues = []
    if spec.sandbox.network and not settings.sandbox_network:
        message = (
            "this server does not give studies network access (the operator sets GROVE_SANDBOX_NETWORK=true)"
        )
        issues.append(SpecIssue(key="sandbox.network", message=message))
    if spec.environment.network and spec.environment.setup and not settings.sandbox_network:
        message = (
            "this server does not give the setup step network access (the operator sets "
            "GROVE_SANDBOX_NETWORK=true); or install from files in the repository (pip install --no-index ...)"
        )
        issues.append(SpecIssue(key="environment.network", message=message))
    if spec.capabilities.calls_model and not registry.model_of(spec):
        message = (
            "policy.kind = 'llm' needs a model, and none is configured: set policy.model in the spec (for "
            "a local server, e.g. 'openai/gemma' with policy.api_base) or GROVE_MODEL on the service"
        )
        issues.append(SpecIssue(key="policy.model", message=message))
    issues += model_issues(spec)
    issues += budget_issues(spec)
    shared = {n.strip() for n in settings.memory_names.split(",") if n.strip()}
    if spec.memory.name and spec.memory.name not in shared:
        message = (
            f"this server shares no lab memory named {spec.memory.name!r} (the operator lists the names "
            "studies may share in GROVE_MEMORY_NAMES); leave it out to share by repository only"
        )
        issues.append(SpecIssue(key="memory.name", message=message))
    if issues:
        raise SpecError(issues, source)


PROBE_SECONDS = 5.0  # a model server that does not answer its models list within this is not there


def model_issues(spec: Spec) -> list[SpecIssue]:
    """Refuse an llm study whose prompts cannot fit its model's input or whose model server does not
    answer, before anything of it runs (the operator's server, and spec servers it allow-lists, are asked)."""
    model = registry.model_of(spec)
    if not spec.capabilities.calls_model or not model:
        return []
    from agents.policies.llm.policy import shortest_prompt

    key = "policy.max_input_tokens"
    setting = (
        "the service's GROVE_LLM_MAX_INPUT_TOKENS" if os.environ.get("GROVE_LLM_MAX_INPUT_TOKENS") else key
    )
    try:
        limit, answers = registry.input_limit(spec), registry.output_limit(spec)
    except registry.PolicyUnavailable as exc:
        return [SpecIssue(key=key, message=str(exc))]
    issues = []
    need = shortest_prompt()
    if limit is not None and limit < need:
        message = (
            f"{setting} = {limit} tokens cannot hold the shortest prompt a role is sent (about {need}): the "
            f"model's context must hold at least {need + answers} tokens, with answers of {answers}"
        )
        issues.append(SpecIssue(key=key, message=message))
    base, _ = registry.endpoint(spec, model)
    server = os.environ.get("GROVE_LLM_API_BASE")
    if base and (server or registry.allowed_base(base)):
        where = ("policy.model", "the service's GROVE_LLM_API_BASE") if server else ("policy.api_base",) * 2
        found = localmodel.probe(base, PROBE_SECONDS)
        parts = urllib.parse.urlsplit(base)  # said to whoever sent the spec: no userinfo, no query
        base = urllib.parse.urlunsplit((parts.scheme, parts.hostname or "", parts.path, "", ""))
        if parts.port:
            base = base.replace(parts.hostname or "", f"{parts.hostname}:{parts.port}", 1)
        if not found.answers:
            message = (
                f"the model server at {base} ({where[1]}) does not answer ({found.error}): start it, or "
                "point the setting at a server that runs"
            )
            issues.append(SpecIssue(key=where[0], message=message))
        elif found.context is not None and (limit is None or limit + answers > found.context):
            message = (
                f"the model server at {base} holds {found.context} tokens of context: set {setting} to at "
                f"most {found.context - answers} (answers take up to {answers})"
            )
            issues.append(SpecIssue(key=key, message=message))
    return issues


def budget_issues(spec: Spec) -> list[SpecIssue]:
    """Refuse a USD budget that cannot hold: an llm study whose model has no price."""
    model = registry.model_of(spec)
    if not spec.capabilities.calls_model or spec.budget.usd <= 0 or not model or registry.prices_of(spec):
        return []
    if not registry.unpriced(model):
        return []
    message = (
        f"litellm has no price for {model!r}, so budget.usd = {spec.budget.usd:g} could never stop the "
        "study: set policy.input_usd_per_mtok and policy.output_usd_per_mtok (USD per million tokens), "
        "or set budget.usd = 0 and budget.tokens to cap a local model by tokens"
    )
    return [SpecIssue(key="policy.input_usd_per_mtok", message=message)]


def register_study(
    s: Session,
    settings: Settings,
    spec_text: str,
    source_repo: str,
    *,
    allow_plain_folder: bool = False,
    spec_source: str = "grove.toml",
    announce: bool = True,
) -> Study:
    """Check a spec and record its study as `cloning`; `clone_study` finishes it (off the request path)."""
    spec = parse_spec(spec_text, spec_source)
    check_operator_limits(settings, spec, spec_source)
    check_new(s, spec, source_repo, allow_plain_folder)
    study = Study(
        name=spec.study.name,
        goal=spec.study.goal,
        spec_toml=spec_text,
        source=source_repo,
        status=str(StudyStatus.CLONING),
        seed=spec.policy.seed,
    )
    s.add(study)
    s.flush()
    if announce:
        add_event(s, study.id or 0, "study.cloning", None, name=study.name, source=source_repo)
    return study


def clone_study(
    s: Session, settings: Settings, study: Study, *, spec_source: str = "grove.toml", policy: bool = False
) -> Study:
    """Clone a `cloning` study's repository, check the spec against it, make trunk and the root node.

    A URL is cloned with the first-byte and overall timeouts; with `policy` (a source given over
    the API) its host is checked again first and git connects to the addresses checked.
    Raises (SpecError, GitError, FileNotFoundError, cloning.HostRefused) leave Grove's clone
    removed; the caller either rolls the study back (a request) or fails it with the reason (a
    background clone).
    """
    settings.ensure_dirs()
    spec = parse_spec(study.spec_toml, spec_source)
    name = study.name
    dest = (settings.data_dir / "repos" / name).resolve()
    shutil.rmtree(dest, ignore_errors=True)
    if gitops.is_url(study.source):
        checked = cloning.check(settings, study.source) if policy else None
        repo = cloning.clone(
            study.source, dest, timeout=settings.clone_timeout,
            first_byte_timeout=settings.clone_first_byte_timeout, checked=checked,
        )  # fmt: skip
    else:
        if policy:  # checked again as it is cloned: the folder may have changed since the request
            check_source(settings, study.source)
        repo = gitops.clone(study.source, dest, timeout=settings.clone_timeout)
    try:
        base = check_spec(spec, repo, spec_source)
        values = base_values(spec, repo, base)
    except Exception:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    trunk = f"grove/{name}/trunk"
    study.repository_key = memory.repository_key(repo, base)
    sealed = globs.select(spec.files.sealed, repo.files_at(base))
    if sealed:
        # Trunk starts from a copy of base without the sealed files and without its history: what
        # a worker fetches (trunk, nodes, gates) then holds no sealed byte. Only sealed jobs read
        # them, from the repository's own commit, kept under a ref no worker's fetch names.
        repo.git("update-ref", f"refs/grove/sealed/{name}", base)
        study.sealed_commit = base
        base = repo.without(base, sealed, f"Grove: {name}'s base without its sealed files")
    repo.set_branch(trunk, base)
    study.repo_path, study.base_commit = str(dest), base
    study.trunk_branch, study.trunk_commit, study.base_values = trunk, base, values
    s.add(study)
    root = Node(
        study_id=study.id or 0,
        depth=0,
        title="baseline (trunk at base)",
        hypothesis={
            "mechanism": "none",
            "hypothesis": "the starting point",
            "observable": "",
            "risks": "",
        },
        origin="baseline",
        status=str(NodeStatus.MERGED),
        edits=dict(values),
        base_commit=base,
        commit=base,
        branch=trunk,
    )
    s.add(root)
    s.flush()
    study.trunk_node_id = root.id
    s.add(study)
    return lifecycle.change(s, study.id or 0, StudyStatus.CREATED, name=name, base=base, source=study.source)


def get_by_name(s: Session, name: str) -> Study | None:
    """Return the study with this name, if any."""
    return s.exec(select(Study).where(Study.name == name)).first()


class NotPromotable(ValueError):
    """The study has no trunk to push, or came from a plain folder with no origin to push it to."""


def promote(s: Session, study: Study, by: str) -> str:
    """Push trunk to the origin as branch `grove/<study>` (never a user branch); return that branch."""
    if not study.repo_path or not study.trunk_commit:
        raise NotPromotable(f"study {study.name!r} has no trunk yet (it is {study.status})")
    if study.trunk_commit == study.base_commit:
        raise NotPromotable(f"trunk of study {study.name!r} has nothing new: no change has been merged yet")
    repo = gitops.Repo(Path(study.repo_path))
    if not repo.git("remote").strip():
        raise NotPromotable(
            f"study {study.name!r} was imported from a folder that is not a git repository; "
            f"fetch its trunk instead: git fetch {study.repo_path} {study.trunk_branch}"
        )
    target = f"grove/{study.name}"
    commit = study.trunk_commit
    if study.sealed_commit:
        # Trunk grew from a copy of base without the sealed files: its change goes back onto the
        # repository's own base as one commit, sealed files as they were.
        sealed = globs.select(spec_of(study).files.sealed, repo.files_at(study.sealed_commit))
        nodes = s.exec(select(Node).where(Node.study_id == study.id, Node.status == NodeStatus.MERGED))
        merged = [n.number for n in nodes if n.parent_id is not None]
        names = ", ".join(f"n{n}" for n in sorted(merged)) or "no node"
        message = f"Grove study {study.name}: trunk {commit[:12]} (merged {names})"
        commit = repo.with_files(commit, study.sealed_commit, sealed, study.sealed_commit, message)
    origin = repo.git("remote", "get-url", "origin").strip()
    # A local origin's receive-pack runs in that repository, with its config: Grove's push runs none
    # of its hooks (command-line config wins over the repository's own).
    local = not gitops.is_url(origin) or origin.lower().startswith("file:")
    wrapper = [f"--receive-pack={gitops.foreign_program('receive-pack')}"] if local else []
    repo.git("push", "--force", *wrapper, "origin", f"{commit}:refs/heads/{target}")
    add_event(s, study.id or 0, "study.promoted", None, branch=target, commit=commit, by=by)
    return target


MAX_INTAKE_BYTES = 200_000
MAX_INTAKE_ROWS_BYTES = 64_000_000  # a data file of rows (CSV, JSON lines) init may split into dev/held-out


def repository_files(path: Path) -> dict[str, str]:
    """Return a repository's (or plain folder's) text files, path -> content, as intake reads them.

    In a git work tree, the files committed at HEAD; in a plain folder, the files on disk. Large
    and binary files, and folders such as `.git`, `.venv` and `node_modules`, are left out; a file
    of rows (`.csv`, `.tsv`, `.jsonl`, `.txt`) may be larger, up to `MAX_INTAKE_ROWS_BYTES`.
    """
    from agents.entrypoints import ROWS

    out: dict[str, str] = {}
    root = path.resolve()
    if gitops.toplevel(root) == root:
        repo = gitops.Repo(root, foreign=True)
        names = repo.files_at("HEAD")
        blobs = {n: (root / n) for n in names}
    else:
        skip = {".git", ".venv", "venv", "node_modules", "__pycache__", ".mypy_cache", ".pytest_cache"}
        blobs = {
            p.relative_to(root).as_posix(): p
            for p in root.rglob("*")
            if p.is_file() and not p.is_symlink() and not skip & set(p.relative_to(root).parts)
        }
    for name, file in sorted(blobs.items()):
        try:
            cap = MAX_INTAKE_ROWS_BYTES if name.lower().endswith(ROWS) else MAX_INTAKE_BYTES
            if file.is_symlink() or file.stat().st_size > cap:
                continue
            data = file.read_bytes()
        except OSError:
            continue
        if b"\0" in data[:4096]:
            continue
        out[name] = data.decode("utf-8", "replace")
    return out
