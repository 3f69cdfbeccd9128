"""Output directories lowbit writes (checkpoints, reports), without ever losing a user's file.

A directory lowbit wrote holds ``lowbit-files.json``, the list of the files lowbit put there.
The rules:
- a missing or empty directory is written;
- a directory lowbit wrote is written again: the files its list names are replaced (or removed
  when the new output has no such file), every other file stays;
- any other non-empty directory is refused unless ``overwrite=True``; then too only lowbit's
  files are written and the others stay, and a file of the user's that lowbit would have to
  replace is refused (move it away first). Foreign ``*.safetensors`` files next to a
  checkpoint are refused as well: a loader would read them as part of it.

Everything is first written to a staging directory next to the target, then moved in by
renames: an exception or Ctrl-C while writing leaves the previous content untouched and no
staging directory. A process killed outright (SIGKILL, power loss) cannot clean up: its hidden
staging directory ``.<name>.lowbit-tmp-*`` stays next to the target, and the next save into
the same target removes it (``clean_stale_stages``: only directories holding lowbit's stage
marker, made by a process of this host that is no longer running). ``check_out_dir`` runs all the checks (including a real write next to the
target) so that a command can fail before its expensive work.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Iterator

MANIFEST = "lowbit-files.json"
_MANIFEST_VERSION = 1
STAGE_MARKER = ".lowbit-stage.json"   # inside a staging directory: who made it (never committed)
_STAGE_INFIX = ".lowbit-tmp-"


class OutputDirError(ValueError):
    """An output directory lowbit must not or cannot write."""


def _files(root: Path) -> set[str]:
    """Relative POSIX paths of every file (and symlink) under root."""
    out = set()
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            out.add(Path(dirpath, n).relative_to(root).as_posix())
    return out


def read_manifest(directory: Path) -> set[str] | None:
    """The files lowbit recorded writing into `directory`, or None when it holds no valid list
    (a list naming paths outside the directory is treated as absent: its files are not lowbit's)."""
    path = Path(directory) / MANIFEST
    if not path.is_file() or path.is_symlink():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) and f for f in files):
        return None
    for f in files:
        p = PurePosixPath(f)
        if p.is_absolute() or ".." in p.parts or f == MANIFEST:
            return None
    return set(files)


def _conflicts(foreign: set[str], new: set[str]) -> list[str]:
    clash = foreign & new
    if any(f.endswith(".safetensors") for f in new):
        clash |= {f for f in foreign if "/" not in f and
                  (f.endswith(".safetensors") or f.endswith(".safetensors.index.json"))}
    return sorted(clash)


def _plan(out: Path, overwrite: bool, what: str) -> tuple[set[str], set[str]]:
    """(lowbit's previous files, the user's files) in `out`; raises OutputDirError when `out`
    must not be written."""
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{what} {out} is a file, not a directory; give a directory path")
    if not out.exists() or not any(out.iterdir()):
        return set(), set()
    mine = read_manifest(out)
    present = _files(out) - {MANIFEST}
    if mine is None:
        if not overwrite:
            raise OutputDirError(f"{what} {out} is not empty and was not written by lowbit "
                                 f"(no {MANIFEST}); choose a new or empty directory, or pass --overwrite to add "
                                 "lowbit's files next to the ones there (none of them is deleted)")
        return set(), present
    return mine & present, present - mine


def probe_writable(directory: str | os.PathLike, what: str) -> None:
    """Check, by creating and removing a directory, that files can be written into `directory`
    (or, when it does not exist yet, into its nearest existing ancestor, where it would be made).
    Nothing is left behind; no permission bits are trusted (root ignores them, /proc refuses)."""
    directory = Path(directory)
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputDirError(f"{what}: {existing} is a file, so no directory can be made under it")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lowbit-probe-", dir=existing))
    except OSError as e:
        raise OutputDirError(f"{what}: cannot write into {existing} ({e.strerror or e}); choose a directory "
                             "you can write to") from e


def check_out_dir(out: str | os.PathLike, overwrite: bool = False, *, what: str = "--out",
                  new_files: set[str] | None = None) -> None:
    """Every check `staged` makes before writing, run up front (before a command's expensive
    work). new_files: names the output will have, when known (e.g. {"model.safetensors"}), to
    find clashes with the user's files now rather than at the end."""
    out = Path(out)
    _mine, foreign = _plan(out, overwrite, what)
    if new_files:
        clash = _conflicts(foreign, set(new_files))
        if clash:
            raise OutputDirError(_clash_message(out, clash, what))
    _probe_target(out, what)


def _probe_target(out: Path, what: str) -> None:
    probe_writable(out.parent, f"{what} {out}")   # the staging directory goes next to `out`
    if out.is_dir():
        probe_writable(out, f"{what} {out}")      # lowbit's files are moved into it


def _clash_message(out: Path, clash: list[str], what: str) -> str:
    return (f"{what} {out} holds files lowbit did not write that its output would replace or mix with: "
            f"{clash[:5]}; move them away or choose another directory")


def _move(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.replace(src, dst)


def _prune_empty_dirs(root: Path, rels: set[str]) -> None:
    for rel in sorted(rels, key=lambda r: -r.count("/")):
        d = (root / rel).parent
        while d != root:
            try:
                d.rmdir()
            except OSError:
                break
            d = d.parent


def _write_manifest(directory: Path, files: set[str]) -> None:
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"format_version": _MANIFEST_VERSION, "files": sorted(files)}, indent=1) + "\n",
                   encoding="utf-8")
    os.replace(tmp, directory / MANIFEST)


def _new_stage(out: Path) -> Path:
    """A fresh hidden staging directory next to `out`, marked as lowbit's with this process's
    id and host (what clean_stale_stages needs to know it is lowbit's and abandoned)."""
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}{_STAGE_INFIX}", dir=out.parent))
    (stage / STAGE_MARKER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}),
                                      encoding="utf-8")
    return stage


def _running(pid: int) -> bool:
    """Whether a process with this id exists on this host (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _abandoned(stage: Path) -> bool:
    """A staging directory whose marker says this host's process `pid` made it, and no process
    with that id runs any more. Anything unreadable or unexpected is not abandoned."""
    marker = stage / STAGE_MARKER
    if stage.is_symlink() or not stage.is_dir() or marker.is_symlink() or not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(info, dict) or info.get("host") != socket.gethostname():
        return False
    pid = info.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or pid == os.getpid():
        return False
    return not _running(pid)


def clean_stale_stages(out: str | os.PathLike) -> list[Path]:
    """Remove the staging directories of earlier saves into `out` whose process was killed
    before it could remove them (named ``.<out name>.lowbit-tmp-*``, holding lowbit's marker,
    made on this host by a process that no longer runs; a save still running is left alone,
    and so is anything else). Returns the directories removed."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    prefix = f".{out.name}{_STAGE_INFIX}"
    removed = []
    for entry in sorted(out.parent.iterdir()):
        if entry.name.startswith(prefix) and _abandoned(entry):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _umask() -> int:
    """The process's umask (read by setting it, the only portable way, and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _commit(stage: Path, out: Path, overwrite: bool, what: str) -> None:
    (stage / STAGE_MARKER).unlink(missing_ok=True)
    new = _files(stage) - {MANIFEST}
    (stage / MANIFEST).unlink(missing_ok=True)  # a nested staged() wrote one; this one covers all
    mine, foreign = _plan(out, overwrite, what)
    if not mine and not foreign:
        _write_manifest(stage, new)
        if out.exists():
            out.rmdir()  # empty (checked by _plan); rename cannot replace it on every platform
        os.chmod(stage, 0o777 & ~_umask())   # mkdtemp made it 0700; the output gets mkdir's mode
        os.rename(stage, out)
        return
    clash = _conflicts(foreign, new)
    if clash:
        raise OutputDirError(_clash_message(out, clash, what))
    backup = Path(tempfile.mkdtemp(prefix=f".{out.name}.lowbit-old-", dir=out.parent))
    moved_old, moved_new = [], []
    try:
        for rel in sorted(mine):
            _move(out / rel, backup / rel)
            moved_old.append(rel)
        for rel in sorted(new):
            _move(stage / rel, out / rel)
            moved_new.append(rel)
        _write_manifest(out, new)
    except BaseException:
        for rel in moved_new:  # undo: the new files back to the stage, the old ones into place
            _move(out / rel, stage / rel)
        for rel in moved_old:
            _move(backup / rel, out / rel)
        shutil.rmtree(backup, ignore_errors=True)
        raise
    _prune_empty_dirs(out, mine - new)
    shutil.rmtree(backup, ignore_errors=True)


@contextmanager
def staged(out: str | os.PathLike, overwrite: bool = False, *, what: str = "--out") -> Iterator[Path]:
    """Yield a staging directory (empty but for lowbit's marker, which is never committed);
    when the block completes, its files become `out`'s by the rules of this module. Stale
    staging directories of killed earlier saves into `out` are removed first. On an exception (Ctrl-C included) `out` is left as it was."""
    out = Path(out)
    _plan(out, overwrite, what)
    _probe_target(out, what)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputDirError(f"{what} {out}: cannot make {out.parent} ({e.strerror or e})") from e
    clean_stale_stages(out)
    stage = _new_stage(out)
    try:
        yield stage
        _commit(stage, out, overwrite, what)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
