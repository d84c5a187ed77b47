"""Golden files: ``golden/<kernel>/<variant>.<ext>`` holding generated text (IR, PTX).

Rules (README "Goldens"):
- text is normalised before it is compared or stored (``\\n`` line ends, no trailing spaces,
  exactly one final newline);
- a mismatch fails with a unified diff (at most ``DIFF_LINES`` lines) and writes
  ``<variant>.obtained.<ext>`` beside the golden (git ignores ``*.obtained.*``);
- a missing golden fails; only ``pytest --update-golden`` creates or rewrites goldens (and
  ``golden/MANIFEST``), never under CI, and it marks the test skipped so the run says
  "regenerated; review the diff";
- ``golden/MANIFEST`` records the toolchain that generated the PTX; a PTX golden made by
  another LLVM major version is skipped with a message, not compared (IR text always is).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = REPO_ROOT / "golden"
MANIFEST = GOLDEN_DIR / "MANIFEST"
DIFF_LINES = 80
OBTAINED = "obtained"


def is_ci() -> bool:
    """True when the environment variable CI is set to anything but '', '0', 'false', 'no'."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")


def normalize(text: str) -> str:
    """``\\n`` line ends, trailing whitespace stripped from every line, trailing blank lines
    dropped, exactly one final newline ("" stays "")."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    body = "\n".join(line.rstrip() for line in lines).rstrip("\n")
    return body + "\n" if body else ""


def golden_path(name: str, ext: str) -> Path:
    """``golden/<kernel>/<variant>.<ext>`` for ``name == "<kernel>/<variant>"``."""
    kernel, sep, variant = name.partition("/")
    if not sep or not kernel or not variant or "/" in variant:
        raise ValueError(f"golden name {name!r} must be '<kernel>/<variant>'")
    return GOLDEN_DIR / kernel / f"{variant}.{ext}"


def obtained_path(path: Path) -> Path:
    """``<variant>.obtained.<ext>`` beside the golden ``<variant>.<ext>``."""
    return path.with_name(f"{path.stem}.{OBTAINED}{path.suffix}")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def diff_text(expected: str, obtained: str, expected_name: str, obtained_name: str,
              limit: int = DIFF_LINES) -> str:
    """Unified diff of two texts, cut to ``limit`` lines with a note saying how many more."""
    lines = list(difflib.unified_diff(expected.splitlines(), obtained.splitlines(),
                                      expected_name, obtained_name, lineterm=""))
    if len(lines) > limit:
        lines = lines[:limit] + [f"... ({len(lines) - limit} more diff lines; compare the files)"]
    return "\n".join(lines)


def check(name: str, ext: str, text: str, update: bool = False) -> None:
    """Compare ``text`` with the golden ``golden/<name>.<ext>``.

    Passes when they are equal (after normalising ``text``). With ``update`` the golden is
    (re)written and the test is skipped. Otherwise a missing or different golden fails the
    test; the obtained text is written beside the golden for inspection.
    """
    path = golden_path(name, ext)
    obtained_file = obtained_path(path)
    text = normalize(text)
    exists = path.is_file()
    expected = path.read_bytes().decode("utf-8") if exists else None

    if update:
        if is_ci():
            pytest.fail("--update-golden is refused under CI (CI is set): goldens are "
                        "regenerated on a developer machine and committed", pytrace=False)
        obtained_file.unlink(missing_ok=True)
        if expected == text:
            return
        _write(path, text)
        verb = "updated" if exists else "created"
        pytest.skip(f"{_rel(path)} {verb}: regenerated; review the diff (git diff golden/)")

    if expected == text:
        obtained_file.unlink(missing_ok=True)
        return

    _write(obtained_file, text)
    if not exists:
        pytest.fail(f"missing golden {_rel(path)}: generate it with 'pytest --update-golden' "
                    f"on a developer machine, review it and commit it (never created under "
                    f"CI); the obtained text is in {_rel(obtained_file)}", pytrace=False)
    diff = diff_text(expected, text, _rel(path), _rel(obtained_file))
    pytest.fail(f"{_rel(path)} differs from the generated text (obtained text written to "
                f"{_rel(obtained_file)}); if the change is intended, run "
                f"'pytest --update-golden' and review the diff.\n{diff}", pytrace=False)


# ---------------------------------------------------------------------------------------------
# MANIFEST: the toolchain the goldens were generated with


def current_toolchain(default_arch: str) -> dict[str, str]:
    """The running toolchain, as MANIFEST records it."""
    import llvmlite
    import llvmlite.binding as llvm

    return {
        "llvmlite": llvmlite.__version__,
        "llvm": ".".join(str(x) for x in llvm.llvm_version_info),
        "default_arch": default_arch,
    }


def read_manifest(path: Path | None = None) -> dict[str, str] | None:
    """``key = value`` lines of MANIFEST (``#`` comments), or None when it does not exist."""
    path = path or MANIFEST
    if not path.is_file():
        return None
    entries = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"{_rel(path)}:{n}: expected 'key = value', got {line!r}")
        entries[key.strip()] = value.strip()
    return entries


def write_manifest(entries: dict[str, str], path: Path | None = None) -> None:
    path = path or MANIFEST
    lines = ["# Toolchain that generated the goldens in this directory.",
             "# Rewritten by `pytest --update-golden`; PTX goldens are skipped, not compared,",
             "# under another LLVM major version (IR text goldens are always compared)."]
    lines += [f"{k} = {v}" for k, v in entries.items()]
    _write(path, "\n".join(lines) + "\n")


def llvm_major(version: str) -> int:
    return int(version.split(".", 1)[0])


def require_manifest_llvm(manifest: dict[str, str] | None, running: dict[str, str]) -> None:
    """Skip a PTX golden comparison made by another LLVM major; fail without a MANIFEST."""
    if manifest is None:
        pytest.fail(f"missing {_rel(MANIFEST)}: run 'pytest --update-golden' on a developer "
                    "machine and commit it", pytrace=False)
    if "llvm" not in manifest:
        pytest.fail(f"{_rel(MANIFEST)} has no 'llvm = X.Y.Z' entry", pytrace=False)
    if llvm_major(manifest["llvm"]) != llvm_major(running["llvm"]):
        pytest.skip(f"PTX goldens were generated with LLVM {manifest['llvm']} (llvmlite "
                    f"{manifest.get('llvmlite', '?')}); this is LLVM {running['llvm']} (llvmlite "
                    f"{running['llvmlite']}): PTX not compared. Regenerate with "
                    "'pytest --update-golden' when moving the pinned llvmlite.")


def golden_files() -> list[Path]:
    """Every file under golden/ except MANIFEST and ``*.obtained.*`` leftovers."""
    if not GOLDEN_DIR.is_dir():
        return []
    return sorted(p for p in GOLDEN_DIR.rglob("*")
                  if p.is_file() and p != MANIFEST and f".{OBTAINED}." not in p.name
                  and p.name != ".gitkeep")


def stale_golden_files(registered: set[str], extensions: tuple[str, ...]) -> list[Path]:
    """Golden files that belong to no registered variant (or have an unknown extension)."""
    stale = []
    for p in golden_files():
        rel = p.relative_to(GOLDEN_DIR)
        ok = (len(rel.parts) == 2 and p.suffix[1:] in extensions
              and f"{rel.parts[0]}/{p.stem}" in registered)
        if not ok:
            stale.append(p)
    return stale
