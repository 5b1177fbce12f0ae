"""What users get from the package beyond the op: the sdist, `python -m fused_ops`."""
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_sdist_carries_the_sources(tmp_path):
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path)],
                   cwd=REPO, check=True, capture_output=True)
    (archive,) = tmp_path.glob("fused_ops-*.tar.gz")
    names = {Path(n).relative_to(Path(n).parts[0]).as_posix()
             for n in tarfile.open(archive).getnames() if len(Path(n).parts) > 1}
    expected = {p.relative_to(REPO).as_posix() for p in (REPO / "csrc").rglob("*")
                if p.suffix in {".h", ".cuh", ".cpp", ".cu"}}
    assert expected and expected <= names, sorted(expected - names)
    assert {"setup.py", "pyproject.toml", "README.md"} <= names


def test_python_m_fused_ops_reports_the_build_and_runs(tmp_path):
    result = subprocess.run([sys.executable, "-m", "fused_ops", "--device", "cpu"],
                            cwd=tmp_path, check=True, capture_output=True, text=True)
    assert "built with" in result.stdout and "'torch':" in result.stdout
    errors = [float(line.split("relerr vs float64 ")[1].split(";")[0])
              for line in result.stdout.splitlines() if "relerr vs float64" in line]
    assert len(errors) == 2 and max(errors) <= 1e-6, result.stdout
