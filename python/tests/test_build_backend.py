"""The package's PEP 517 backend (build_backend/): standard library only, so `pip install ./python`
needs no index. Its wheel holds the package and valid metadata and RECORD, and a library copied
into the package folder; its fallback pyproject reader agrees with tomllib."""

import base64
import hashlib
import importlib.util
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

PYTHON_DIR = Path(__file__).resolve().parents[1]


def load_backend(root):
    spec = importlib.util.spec_from_file_location(
        f"backend_{id(root)}", root / "build_backend" / "rope_jit_build_backend.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pyproject_asks_pip_for_nothing():
    text = (PYTHON_DIR / "pyproject.toml").read_text()
    build_system = load_backend(PYTHON_DIR).read_project_table(text)["build-system"]
    assert build_system["requires"] == []
    assert build_system["build-backend"] == "rope_jit_build_backend"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_the_fallback_pyproject_reader_agrees_with_tomllib():
    import tomllib

    text = (PYTHON_DIR / "pyproject.toml").read_text()
    assert load_backend(PYTHON_DIR).read_project_table(text) == tomllib.loads(text)


def test_the_wheel_holds_the_package_metadata_and_a_record_that_matches(tmp_path):
    root = tmp_path / "python"
    shutil.copytree(
        PYTHON_DIR, root, ignore=shutil.ignore_patterns("__pycache__", "tests", ".pytest_cache")
    )
    (root / "rope_jit" / "librope_jit.so.0").write_bytes(b"\x7fELF stand-in")
    (root / "rope_jit" / "notes.txt").write_text("not shipped")
    backend = load_backend(root)
    name = backend.build_wheel(str(tmp_path))
    assert name == "rope_jit-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(tmp_path / name) as wheel:
        names = wheel.namelist()
        assert "rope_jit/__init__.py" in names and "rope_jit/dropin/hf.py" in names
        assert "rope_jit/librope_jit.so.0" in names and "rope_jit/notes.txt" not in names
        assert not [entry for entry in names if "__pycache__" in entry]
        metadata = wheel.read("rope_jit-0.1.0.dist-info/METADATA").decode()
        assert (
            "Name: rope-jit" in metadata
            and 'Requires-Dist: numpy>=1.22; extra == "numpy"' in metadata
        )
        record = wheel.read("rope_jit-0.1.0.dist-info/RECORD").decode().splitlines()
        for line in record:
            entry, digest, size = line.rsplit(",", 2)
            if entry.endswith("RECORD"):
                continue
            data = wheel.read(entry)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={expected}" and int(size) == len(data), entry
        assert len(record) == len(names)


def test_the_editable_wheel_points_at_the_checkout_and_the_sdist_has_the_sources(tmp_path):
    backend = load_backend(PYTHON_DIR)
    name = backend.build_editable(str(tmp_path))
    with zipfile.ZipFile(tmp_path / name) as wheel:
        assert wheel.read("_rope_jit_editable.pth").decode().strip() == str(PYTHON_DIR)
    import tarfile

    with tarfile.open(tmp_path / backend.build_sdist(str(tmp_path))) as sdist:
        members = sdist.getnames()
    assert "rope_jit-0.1.0/pyproject.toml" in members
    assert "rope_jit-0.1.0/build_backend/rope_jit_build_backend.py" in members
    assert "rope_jit-0.1.0/rope_jit/torch_ops.py" in members
