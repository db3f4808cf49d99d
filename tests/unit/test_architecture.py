"""The shape of the code (issue 16): the import contracts in pyproject.toml
([tool.importlinter]) hold. Each contract's ignore_imports lists today's known
breaches; a new one fails here, naming the import."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_import_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "lint-imports (import-linter, a test dependency) is not installed"
    done = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_no_breach_is_let_through():
    """The contracts hold with no ignore list: a breach is fixed, not listed."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    ignored = [i for c in config["contracts"] for i in c.get("ignore_imports", [])]
    assert ignored == [], ignored


def _outside_store() -> list[Path]:
    package = ROOT / "recovery_agent"
    return sorted(p for p in package.rglob("*.py") if (package / "store") not in p.parents)


def _sql_breaches(source: str) -> list[str]:
    """What in ``source`` speaks SQL itself: an import of sqlite3 or
    sqlite_utils, or any attribute ``.db`` (the store's sqlite-utils Database;
    nothing else in the package is called that)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            names = []
        found += [f"line {node.lineno}: import {n}" for n in names
                  if n.split(".")[0] in ("sqlite3", "sqlite_utils")]
        if isinstance(node, ast.Attribute) and node.attr == "db":
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_store_speaks_sql():
    """No module outside recovery_agent/store/ imports sqlite3 or sqlite_utils or
    touches a store's ``.db``: every statement is a named store method. (The
    import-linter contract lists modules; this covers every file, new ones too.)"""
    breaches = {str(p.relative_to(ROOT)): _sql_breaches(p.read_text(encoding="utf-8"))
                for p in _outside_store()}
    assert {p: b for p, b in breaches.items() if b} == {}


def test_the_sql_check_sees_each_kind_of_breach():
    source = ("import sqlite3\nfrom sqlite_utils.db import NotFoundError\n"
              "def f(self, store):\n    store.db.execute('x')\n"
              "    return self.store.db['jobs']\n")
    assert sorted(_sql_breaches(source)) == [
        "line 1: import sqlite3", "line 2: import sqlite_utils.db",
        "line 4: store.db", "line 5: self.store.db"]
    assert _sql_breaches("def f(store):\n    return store.jobs(), store.path\n") == []
