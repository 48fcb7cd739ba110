"""constraints.txt: write it from a venv that passed the suite, or compare a venv with it.

    python .ci/constraints.py freeze VENV_PYTHON   # rewrite constraints.txt from that venv
    python .ci/constraints.py diff VENV_PYTHON     # which versions differ from constraints.txt

`make` installs with `-c constraints.txt`, so a new upstream release cannot change
what `make test` and CI run; `make test-latest` resolves without it and calls `diff`.
"""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"
HEADER = """\
# Exact versions of every package (direct and transitive) that passed `make test`.
# make installs with `-c constraints.txt`; refresh with `make test-latest` (a
# separate venv resolved without it), then `make constraints` once that passes.
# torch carries no local label (+cpu) so that a CUDA build of the same version
# satisfies it on a GPU machine.
"""


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read(lines: list[str]) -> dict[str, tuple[str, str]]:
    """{normalised name: (name, version)} from `name==version` lines."""
    pins = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = (part.strip() for part in line.split("==", 1))
            pins[norm(name)] = (name, version.split("+", 1)[0])
    return pins


def freeze(python: str) -> dict[str, tuple[str, str]]:
    out = subprocess.run([python, "-m", "pip", "freeze", "--all", "--exclude-editable"],
                         check=True, capture_output=True, text=True).stdout
    pins = read(out.splitlines())
    pins.pop("formwork", None)
    return pins


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("freeze", "diff"):
        print(__doc__, file=sys.stderr)
        return 2
    current = freeze(argv[1])
    if argv[0] == "freeze":
        body = "".join(f"{name}=={version}\n" for name, version in sorted(current.values(),
                                                                         key=lambda p: norm(p[0])))
        CONSTRAINTS.write_text(HEADER + body)
        print(f"wrote {len(current)} pins to {CONSTRAINTS}")
        return 0
    pinned = read(CONSTRAINTS.read_text().splitlines())
    rows = []
    for key in sorted(set(pinned) | set(current)):
        old = pinned.get(key, (key, "-"))[1]
        new = current.get(key, (key, "-"))[1]
        if old != new:
            rows.append(f"  {pinned.get(key, current.get(key))[0]}: {old} -> {new}")
    print(f"versions that differ from constraints.txt ({len(rows)}; '-' = not installed):")
    print("\n".join(rows) if rows else "  none")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
