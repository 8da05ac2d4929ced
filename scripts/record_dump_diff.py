"""Compare two folders written by scripts/record_dump.sh: every file byte for byte, except the
wall-clock times that `train` records by design (its summary line's "seconds", the times on its
progress lines, and the "seconds" of resume.safetensors' metadata: the resumed run's clock), which
are masked, and paths (the dump's folder and the checkout's in stdout, commands.txt and a view
page's "source"); resume.safetensors is then compared tensor by
tensor and key by key.

    python scripts/record_dump_diff.py OLD NEW     # exit 1 and name each differing file
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

#: the fixtures folder of a checkout, as commands.txt names it
FIXTURES = re.compile(r"/\S+/fixtures/")
#: a duration on a progress line ("0.8 s", "~3.3 s left")
SECONDS = re.compile(r"\d+(?:\.\d+)? s\b")


def _masked_json_lines(text: str) -> str:
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            rows.append(line)
            continue
        if isinstance(row, dict):
            row.pop("seconds", None)
        rows.append(json.dumps(row, sort_keys=True))
    return "\n".join(rows)


def _resume_equal(old: Path, new: Path) -> bool:
    import torch
    from safetensors import safe_open

    a, b = safe_open(str(old), "pt"), safe_open(str(new), "pt")
    meta_a, meta_b = dict(a.metadata() or {}), dict(b.metadata() or {})
    for meta in (meta_a, meta_b):
        if "resume" in meta:
            resume = json.loads(meta["resume"])
            resume.pop("seconds", None)
            meta["resume"] = json.dumps(resume, sort_keys=True)
    if meta_a != meta_b or set(a.keys()) != set(b.keys()):
        return False
    return all(torch.equal(a.get_tensor(key), b.get_tensor(key)) for key in a.keys())


def _paths_masked(text: str, root: Path) -> str:
    """`text` with the dump's folder written OUT and a checkout's fixtures folder REPO/fixtures/."""
    return FIXTURES.sub("REPO/fixtures/", text.replace(str(root), "OUT"))


def same(old: Path, new: Path, relative: str, roots: tuple[Path, Path]) -> tuple[bool, bool]:
    """Return (equal, masked): whether the two files are equal, and whether a mask was needed."""
    if old.read_bytes() == new.read_bytes():
        return True, False
    name = Path(relative)
    if name.suffix in (".out", ".html", ".txt") and not name.name.startswith("train_"):
        # what names a path: the output folder (stdout's "wrote OUT/..."), the checkpoint's (a page's source)
        return _paths_masked(old.read_text(), roots[0]) == _paths_masked(new.read_text(), roots[1]), True
    if name.parts[0].startswith("train_") and name.name == "resume.safetensors":
        return _resume_equal(old, new), True
    if name.name.startswith("train_") and name.suffix == ".out":
        return _masked_json_lines(old.read_text()) == _masked_json_lines(new.read_text()), True
    if name.name.startswith("train_") and name.suffix == ".err":
        return SECONDS.sub("T s", old.read_text()) == SECONDS.sub("T s", new.read_text()), True
    return False, False


def main() -> None:
    old_root, new_root = Path(sys.argv[1]), Path(sys.argv[2])
    old_files = {str(p.relative_to(old_root)) for p in old_root.rglob("*") if p.is_file()}
    new_files = {str(p.relative_to(new_root)) for p in new_root.rglob("*") if p.is_file()}
    problems = [f"only in {old_root}: {f}" for f in sorted(old_files - new_files)]
    problems += [f"only in {new_root}: {f}" for f in sorted(new_files - old_files)]
    masked = []
    for relative in sorted(old_files & new_files):
        equal, was_masked = same(old_root / relative, new_root / relative, relative, (old_root, new_root))
        if not equal:
            problems.append(f"differs: {relative}")
        elif was_masked:
            masked.append(relative)
    print(f"{len(old_files & new_files)} files compared: {len(old_files & new_files) - len(masked)} byte-identical, "
          f"{len(masked)} equal but for paths or train's wall-clock times ({', '.join(masked) or 'none'})")
    for problem in problems:
        print(problem)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
