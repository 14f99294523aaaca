"""The PEP 517 build backend of the rope-jit Python package: standard library only.

pip builds a package in an isolated environment into which it installs the backend's
requirements from an index; setuptools there made `pip install ./python` fail without a
network. This backend needs nothing (pyproject.toml: requires = [], backend-path), so the
install works offline, with or without build isolation.

What it builds, from pyproject.toml's [project] table (the one statement of the metadata):
  * a wheel (py3-none-any) of rope_jit/**.py, plus rope_jit/librope_jit.so* when a library
    was copied there before building (it then ships with the package);
  * an editable wheel (pip install -e): a .pth file naming this folder;
  * an sdist of the package folder's sources.

pyproject.toml is read with tomllib (Python >= 3.11), else with read_project_table below,
which knows the subset this file uses (strings, lists of strings, inline tables of strings,
table headers); the tests check that both agree.
"""

import base64
import hashlib
import io
import re
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the python/ folder
PACKAGE = "rope_jit"
_LIBRARY_PATTERN = re.compile(r"^librope_jit\.so(\.\d+)*$")

# --------------------------------------------------------------------------------------------
# pyproject.toml
# --------------------------------------------------------------------------------------------

_STRING = r'"(?:[^"\\]|\\.)*"'


def _parse_value(text):
    text = text.strip()
    if text.startswith('"'):
        return _unquote(text)
    if text.startswith("["):
        return [_unquote(item) for item in re.findall(_STRING, text)]
    if text.startswith("{"):
        return {
            key: _unquote(value)
            for key, value in re.findall(r"([A-Za-z0-9_-]+)\s*=\s*(" + _STRING + ")", text)
        }
    raise ValueError(
        f"pyproject.toml: unsupported value {text!r} (the fallback reader knows strings, lists "
        "and inline tables)"
    )


def _unquote(text):
    return text[1:-1].encode().decode("unicode_escape")


def read_project_table(text):
    """The tables of a TOML document limited to this pyproject's subset, as nested dicts:
    {"project": {...}, "project.optional-dependencies": {...}, ...} folded into one tree."""
    document, table = {}, None
    pending = ""
    for raw in text.splitlines():
        line = raw.split(" #")[0].strip() if not pending else raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if not pending and line.startswith("[") and not line.startswith("[["):
            table = document
            for part in line.strip("[]").split("."):
                table = table.setdefault(part.strip(), {})
            continue
        pending = (pending + " " + line) if pending else line
        if pending.count("[") > pending.count("]") or pending.count("{") > pending.count("}"):
            continue  # a value continued on the next line
        key, _, value = pending.partition("=")
        pending = ""
        if table is None:
            raise ValueError(f"pyproject.toml: a key before any table: {raw!r}")
        table[key.strip().strip('"')] = _parse_value(value)
    return document


def _pyproject():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        return read_project_table(text)
    return tomllib.loads(text)


def _project():
    return _pyproject()["project"]


def _distribution_name(project):
    return re.sub(r"[-_.]+", "_", project["name"]).lower()


def metadata_text(project):
    """The METADATA (core metadata 2.1) of `project` (a [project] table)."""
    lines = ["Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {project['version']}"]
    if "description" in project:
        lines.append(f"Summary: {project['description']}")
    if "requires-python" in project:
        lines.append(f"Requires-Python: {project['requires-python']}")
    license_ = project.get("license")
    if isinstance(license_, dict) and "text" in license_:
        lines.append(f"License: {license_['text']}")
    for requirement in project.get("dependencies", []):
        lines.append(f"Requires-Dist: {requirement}")
    for extra, requirements in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        for requirement in requirements:
            marker = f'extra == "{extra}"'
            lines.append(
                f"Requires-Dist: {requirement}; {marker}"
                if ";" not in requirement
                else f"Requires-Dist: {requirement} and {marker}"
            )
    readme = project.get("readme")
    body = ""
    if isinstance(readme, str) and (ROOT / readme).is_file():
        lines.append("Description-Content-Type: text/markdown")
        body = "\n" + (ROOT / readme).read_text(encoding="utf-8")
    return "\n".join(lines) + "\n" + body


# --------------------------------------------------------------------------------------------
# Wheels
# --------------------------------------------------------------------------------------------


def package_files():
    """(path in the wheel, file on disk) of the package: every .py under rope_jit/ and a
    librope_jit.so* copied next to __init__.py; no caches, sorted (reproducible wheels)."""
    files = []
    for path in sorted((ROOT / PACKAGE).rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        relative = path.relative_to(ROOT).as_posix()
        if path.suffix == ".py" or (
            path.parent == ROOT / PACKAGE and _LIBRARY_PATTERN.match(path.name)
        ):
            files.append((relative, path))
    return files


def _record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _write_wheel(directory, contents):
    """Writes a wheel holding `contents` ((name, bytes) pairs) plus its dist-info; returns
    its file name."""
    project = _project()
    name, version = _distribution_name(project), project["version"]
    dist_info = f"{name}-{version}.dist-info"
    contents = list(contents) + [
        (f"{dist_info}/METADATA", metadata_text(project).encode()),
        (
            f"{dist_info}/WHEEL",
            b"Wheel-Version: 1.0\nGenerator: rope_jit_build_backend\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n",
        ),
        (f"{dist_info}/top_level.txt", f"{PACKAGE}\n".encode()),
    ]
    record = (
        "\n".join(_record_line(entry, data) for entry, data in contents)
        + f"\n{dist_info}/RECORD,,\n"
    )
    contents.append((f"{dist_info}/RECORD", record.encode()))
    wheel_name = f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(Path(directory) / wheel_name, "w", zipfile.ZIP_DEFLATED) as wheel:
        for entry, data in contents:
            info = zipfile.ZipInfo(entry, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(info, data)
    return wheel_name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _write_wheel(
        wheel_directory, [(name, path.read_bytes()) for name, path in package_files()]
    )


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    # A .pth line puts this folder on sys.path: rope_jit is imported from the checkout.
    return _write_wheel(
        wheel_directory, [(f"_{PACKAGE}_editable.pth", (str(ROOT) + "\n").encode())]
    )


def _prepare_metadata(metadata_directory):
    project = _project()
    dist_info = (
        Path(metadata_directory) / f"{_distribution_name(project)}-{project['version']}.dist-info"
    )
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(metadata_text(project), encoding="utf-8")
    return dist_info.name


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _prepare_metadata(metadata_directory)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _prepare_metadata(metadata_directory)


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


# --------------------------------------------------------------------------------------------
# Source distributions
# --------------------------------------------------------------------------------------------


def build_sdist(sdist_directory, config_settings=None):
    project = _project()
    base = f"{_distribution_name(project)}-{project['version']}"
    sources = [("pyproject.toml", ROOT / "pyproject.toml"), ("README.md", ROOT / "README.md")]
    sources += [
        (path.relative_to(ROOT).as_posix(), path)
        for path in sorted((ROOT / "build_backend").glob("*.py"))
    ]
    sources += [(name, path) for name, path in package_files() if path.suffix == ".py"]
    archive = f"{base}.tar.gz"
    with tarfile.open(Path(sdist_directory) / archive, "w:gz", format=tarfile.PAX_FORMAT) as tar:

        def add(name, data):
            info = tarfile.TarInfo(f"{base}/{name}")
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))

        add("PKG-INFO", metadata_text(project).encode())
        for name, path in sources:
            if path.is_file():
                add(name, path.read_bytes())
    return archive


__all__ = [
    "build_wheel",
    "build_editable",
    "build_sdist",
    "prepare_metadata_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "get_requires_for_build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
]
