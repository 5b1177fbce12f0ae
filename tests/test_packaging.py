"""What users get from the package beyond the op: the sdist's contents, `python -m fused_ops`,
build_info. Nothing here writes into the source tree: the sdist is built from a copy of it
in a temporary directory, and nothing is compiled (a CUDA build takes many minutes)."""
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import fused_ops
from conftest import REPO


def source_files():
    """The tree's files as git sees them (tracked, and untracked ones not ignored)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout to list the source files")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, check=True, capture_output=True).stdout
    return [name for name in listed.decode().split("\0") if name and (REPO / name).is_file()]


@pytest.mark.slow
def test_sdist_carries_the_sources(tmp_path):
    tree = tmp_path / "tree"
    for name in source_files():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, tree / name)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(dist)],
                   cwd=tree, check=True, capture_output=True,
                   env={**os.environ, "FUSED_OPS_FORCE_CPU": "1"})
    (archive,) = dist.glob("fused_ops-*.tar.gz")
    names = {Path(n).relative_to(Path(n).parts[0]).as_posix()
             for n in tarfile.open(archive).getnames() if len(Path(n).parts) > 1}
    expected = {p.relative_to(tree).as_posix() for p in (tree / "csrc").rglob("*")
                if p.suffix in {".h", ".cuh", ".cpp", ".cu"}}
    assert expected and expected <= names, sorted(expected - names)
    expected_py = {p.relative_to(tree).as_posix() for p in (tree / "fused_ops").glob("*.py")}
    assert expected_py <= names, sorted(expected_py - names)
    assert {"setup.py", "pyproject.toml", "README.md"} <= names
    assert not any(n.endswith(".so") for n in names)


def test_python_m_fused_ops_reports_the_build_and_runs(tmp_path):
    """From another directory, with the source tree's package on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    result = subprocess.run([sys.executable, "-m", "fused_ops", "--device", "cpu"],
                            cwd=tmp_path, check=True, capture_output=True, text=True, env=env)
    assert "built with" in result.stdout and "'torch':" in result.stdout
    errors = [float(line.split("relerr vs float64 ")[1].split(";")[0])
              for line in result.stdout.splitlines() if "relerr vs float64" in line]
    assert len(errors) == 2 and max(errors) <= 1e-6, result.stdout


def test_build_info_reports_the_build():
    info = fused_ops.build_info()
    assert info["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert "cuda_archs" in info
    assert (info["cuda_archs"] is None) == (info["cuda_toolkit"] is None)


def test_a_build_for_another_torch_refuses_to_import(monkeypatch):
    """The extension loads only under the torch it was built against: any other fails at
    import with a message naming both versions and how to rebuild, not later with a crash."""
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    with pytest.raises(ImportError, match=r"built against torch .* but torch 0\.0\.0-other .*rebuild"):
        fused_ops._check_built_torch()


def test_a_source_tree_without_the_extension_says_how_to_build(tmp_path):
    """Importing an unbuilt fused_ops (a source tree on sys.path) names the fix, not a circular
    import."""
    shutil.copytree(REPO / "fused_ops", tmp_path / "fused_ops",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    # Without site (-S) no .pth file runs, so an installed or editable fused_ops cannot answer
    # the import: the copy in the working directory does; torch comes from its own folder.
    env = {**os.environ, "PYTHONPATH": str(Path(torch.__file__).parent.parent)}
    run = subprocess.run([sys.executable, "-S", "-c", "import fused_ops"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert run.returncode != 0
    assert "has no compiled extension" in run.stderr and "pip install" in run.stderr


def test_the_source_files_the_tree_names_exist():
    """A kernel or header named in a comment, a docstring or the docs is found under that name:
    files move (one folder per algorithm) and their references must follow. Included headers
    (ATen's, CUDA's, ours: the compiler checks those) and files kept only in the lab notebook
    (commit f692131, tagged ``lab-notebook``) are left out."""
    files = source_files()
    names = {Path(name).name for name in files}
    reference = re.compile(r"\b([A-Za-z0-9_]+\.(?:cu|cuh|cpp))\b|\b([a-z0-9_]+\.h)\b")
    # Named outside an #include: CUDA's header setup.py looks for, the header it generates.
    not_ours = {"cuda_runtime_api.h", "fused_ops_build_info.h"}
    missing = []
    for name in files:
        if not name.endswith((".py", ".md", ".cu", ".cuh", ".cpp", ".h", ".sh", ".toml")):
            continue
        for number, line in enumerate((REPO / name).read_text(errors="replace").splitlines(), 1):
            if line.lstrip().startswith("#include") or any(
                    mark in line for mark in ("lab-notebook", "f692131")):
                continue
            for match in reference.finditer(line):
                file = match.group(1) or match.group(2)
                # len > 4: not a member access such as `a.h` in code
                if file not in names and file not in not_ours and len(file) > 4:
                    missing.append(f"{name}:{number}: {file}")
    assert not missing, "references to files the tree does not have:\n" + "\n".join(missing)
