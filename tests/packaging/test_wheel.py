"""The wheel installs one top-level package, `kvstore` (client/ and daemon/ as kvstore.client and
kvstore.daemon), and imports beside python-daemon's `daemon` and an app's own `client.py`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (whl,) = out.glob("*.whl")
    return whl


def test_the_wheel_holds_one_top_level_package_under_a_name_of_its_own(wheel):
    assert wheel.name.startswith("mlx_kvstore-")  # `kvstore` on the index is another project
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"kvstore", f"{wheel.name.split('-py3')[0]}.dist-info"}
    for package in ("kvstore/client/", "kvstore/daemon/", "kvstore/daemon/cli/service/"):
        assert f"{package}__init__.py" in names
    meta = wheel.name.split("-py3")[0] + ".dist-info"
    entry_points = zipfile.ZipFile(wheel).read(f"{meta}/entry_points.txt").decode()
    targets = [line.split("=", 1)[1].strip() for line in entry_points.splitlines() if "=" in line]
    assert targets and all(t.startswith("kvstore.") for t in targets), targets


def test_it_imports_beside_python_daemon_and_an_apps_own_client_module(wheel, tmp_path):
    pytest.importorskip("daemon", reason="python-daemon (the test extra) is not installed")
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), wheel],
        check=True,
        capture_output=True,
        timeout=300,
    )
    app = tmp_path / "app"
    app.mkdir()
    (app / "client.py").write_text("APP_CLIENT = True\n")  # an app's own module, as many have
    code = textwrap.dedent(
        f"""
        import client, daemon
        assert client.APP_CLIENT and hasattr(daemon, "DaemonContext"), (client, daemon)
        import kvstore
        assert kvstore.__file__.startswith({str(site)!r}), kvstore.__file__
        from kvstore.client import PersistentPromptCache, hydrate, load
        from kvstore.daemon import Daemon
        from kvstore.tiny import make_tiny_model
        print("ok")
        """
    )
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=app, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_users_type_checker_sees_the_public_names_types(wheel, tmp_path):
    """The lazy exports keep their types for a user's mypy (PEP 561 marker, TYPE_CHECKING
    imports): installed as a wheel in a venv of its own, every public name of `kvstore` and
    `kvstore.client` is revealed as its real type, none as Any."""
    pytest.importorskip("mypy", reason="mypy (the test extra) is not installed")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python3*/site-packages")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), wheel],
        check=True,
        capture_output=True,
        timeout=300,
    )
    import kvstore
    import kvstore.client

    names = [f"kvstore.{n}" for n in kvstore.__all__]
    names += [f"kvstore.client.{n}" for n in kvstore.client.__all__]
    app = tmp_path / "app.py"
    app.write_text("import kvstore\nimport kvstore.client\n" + "".join(
        f"reveal_type({n})\n" for n in names
    ))  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--python-executable", str(venv / "bin" / "python"),
         "--ignore-missing-imports", "--no-incremental", "--follow-imports=silent", str(app)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    revealed = [line for line in out.stdout.splitlines() if "Revealed type" in line]
    assert len(revealed) == len(names), out.stdout + out.stderr
    untyped = [f"{n}: {line}" for n, line in zip(names, revealed) if '"Any"' in line]
    assert not untyped, "\n".join(untyped)
