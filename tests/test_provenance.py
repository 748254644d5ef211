"""Provenance from an installed package: the commit is the checkout a benchmark is started in
when the package itself is not in a git checkout (it read the package's `parents[2]`, which is
a site-packages folder once installed)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

from cagrpo_ray.metrics import provenance

pytestmark = pytest.mark.unit


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def test_an_installed_package_reports_the_working_directorys_commit(tmp_path, monkeypatch):
    installed = tmp_path / "site-packages" / "cagrpo_ray" / "metrics"
    installed.mkdir(parents=True)
    shutil.copy(provenance.__file__, installed / "provenance.py")
    spec = importlib.util.spec_from_file_location("installed", installed / "provenance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    checkout = tmp_path / "checkout"
    (checkout / "configs").mkdir(parents=True)
    (checkout / "configs" / "a.yaml").write_text("run: {}\n")
    git(checkout, "init", "-q")
    git(checkout, "add", ".")
    git(checkout, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    monkeypatch.chdir(checkout)
    assert module.checkout() == checkout
    assert module.git_commit() == git(checkout, "rev-parse", "--short", "HEAD")
    (checkout / "configs" / "a.yaml").write_text("run: {steps: 2}\n")
    assert module.git_commit().endswith("(cagrpo_ray/ or configs/ modified)")


def test_the_packages_own_checkout_comes_first():
    repo = Path(provenance.__file__).resolve().parents[2]
    assert provenance.checkout() == repo  # this repository: the package is in it
