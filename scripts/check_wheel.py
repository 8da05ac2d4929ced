#!/usr/bin/env python
"""Build hookmech's sdist and wheel, install the wheel into a fresh virtual environment and run
`hookmech demo` there, from a folder outside the source tree.

    python scripts/check_wheel.py              # CI (.ci/run); needs the dev extra (build)
    python scripts/check_wheel.py --keep DIR   # keep the sdist, wheel and venv in DIR

Packaging mistakes fail it: a subpackage missing from pyproject.toml, data files not shipped,
a console script that does not start, a dependency that is used but not declared.

The fresh venv gets its third-party packages from the current environment instead of the
network (torch alone is a ~200 MB wheel): exactly the distributions that hookmech's declared
dependencies need, found by walking their requirements in the current environment, are linked
into one folder that a .pth file puts on the fresh venv's path. So an import of a package that
is installed here but not declared (say, a test-only one) still fails there. The wheel itself
is installed with --no-deps (by this environment's pip: the fresh venv has no pip or setuptools of
its own), and `pip check` confirms its declared requirements are met.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def step(message: str) -> float:
    print(f"[check_wheel] {message}", flush=True)
    return time.perf_counter()


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return subprocess.run([str(a) for a in argv], check=True, env=env, **kwargs)


def dependency_closure(requirements: list[str]) -> list[md.Distribution]:
    """The installed distributions that `requirements` need, transitively (markers and extras
    evaluated for this interpreter). A requirement that is not installed here is an error."""
    found: dict[str, md.Distribution] = {}
    todo = [(Requirement(r), "hookmech") for r in requirements]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, wanted_by = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        try:
            dist = found.get(name) or md.distribution(req.name)
        except md.PackageNotFoundError:
            raise SystemExit(f"[check_wheel] {req} (needed by {wanted_by}) is not installed in this environment") from None
        found[name] = dist
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}) or any(
                    sub.marker.evaluate({"extra": extra}) for extra in req.extras):
                sub.marker = None
                todo.append((sub, dist.metadata["Name"]))
    return list(found.values())


def link_view(dists: list[md.Distribution], view: Path) -> int:
    """Symlink each distribution's top-level entries (packages, modules, .libs folders,
    .dist-info) into `view`; return how many were linked."""
    view.mkdir(parents=True)
    linked = 0
    for dist in dists:
        site = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or []}
        tops.add(Path(dist._path).name)  # the .dist-info folder itself (importlib.metadata, pip check)
        for top in sorted(tops):
            if top == ".." or top.endswith(".pth") or top == "__pycache__":
                continue
            source, target = site / top, view / top
            if source.exists() and not target.exists():
                target.symlink_to(source)
                linked += 1
    return linked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="hookmech-wheel-"))
    if args.keep and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        t = step(f"python -m build: sdist, then the wheel from the sdist, into {work / 'dist'}")
        run([sys.executable, "-m", "build", "--outdir", work / "dist", ROOT], stdout=subprocess.DEVNULL)
        wheel = next((work / "dist").glob("hookmech-*.whl"))
        sdist = next((work / "dist").glob("hookmech-*.tar.gz"))
        print(f"  {wheel.name} ({wheel.stat().st_size // 1024} KiB), {sdist.name} "
              f"({sdist.stat().st_size // 1024} KiB) in {time.perf_counter() - t:.1f} s")

        t = step("a fresh venv; the declared dependencies linked in from this environment")
        venv = work / "venv"
        run([sys.executable, "-m", "venv", "--without-pip", venv])  # this environment's pip installs into it
        python = venv / "bin" / "python"
        requires = md.Distribution.at(_unpacked_metadata(wheel, work)).requires or []
        dists = dependency_closure(requires)
        n_links = link_view(dists, work / "deps")
        purelib = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                      capture_output=True, text=True).stdout.strip()
        (Path(purelib) / "_hookmech_ci_deps.pth").write_text(f"{work / 'deps'}\n")
        print(f"  {len(dists)} distributions ({n_links} entries) in {time.perf_counter() - t:.1f} s")

        t = step(f"pip install --no-deps {wheel.name}; pip check")
        pip = [sys.executable, "-m", "pip", "--python", python, "--disable-pip-version-check"]
        run([*pip, "install", "-q", "--no-deps", "--no-index", wheel])
        run([*pip, "check"], stdout=subprocess.DEVNULL)
        print(f"  in {time.perf_counter() - t:.1f} s")

        outside = work / "elsewhere"
        outside.mkdir()
        t = step(f"from {outside}: the installed package, its metadata, then `hookmech demo`")
        probe = ("import hookmech, importlib.metadata as m; d = m.metadata('hookmech'); "
                 "print(f\"  hookmech {hookmech.__version__} from {hookmech.__file__}; "
                 "license {d['License-Expression']}\")")
        run([python, "-c", probe], cwd=outside)
        run([venv / "bin" / "hookmech", "--version"], cwd=outside)
        run([venv / "bin" / "hookmech", "demo"], cwd=outside)
        print(f"  demo in {time.perf_counter() - t:.1f} s")
    except subprocess.CalledProcessError as error:
        print(f"[check_wheel] FAILED: {' '.join(map(str, error.cmd))} exited {error.returncode}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"[check_wheel] the wheel installs and runs the demo ({time.perf_counter() - started:.1f} s in all)")
    return 0


def _unpacked_metadata(wheel: Path, work: Path) -> Path:
    """Extract the wheel's .dist-info (to read its Requires-Dist) and return its path."""
    import zipfile

    target = work / "wheel-metadata"
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.split("/")[0].endswith(".dist-info")]
        archive.extractall(target, names)
    return next(target.glob("*.dist-info"))


if __name__ == "__main__":
    sys.exit(main())
