"""The real fedgc ServerApp and ClientApp packaged as a Flower app for ``flwr run``.

The repository's ``pyproject.toml`` is the package's, so a deployment builds its own small app
folder: a ``pyproject.toml`` whose ``[tool.flwr.app.config]`` holds every key of the run's
:class:`fedgc.settings.RunConfig` (already validated and resolved), and two shim modules that
re-export ``server.app:app`` and ``client.app:app``. The SuperLink's and SuperNodes' app processes
import the real packages from the repository, which :func:`repo_root` puts on their
``PYTHONPATH``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from .files import private_dir
from .toml_values import toml_value

APP_PACKAGE = "fedgc_deploy_app"


def repo_root() -> Path:
    """The folder that holds the ``dgc``, ``client``, ``server`` and ``tasks`` packages."""
    return Path(__file__).resolve().parents[2]


#: The ClientApp of a deployment with phones: ``client.app`` on a node without a phone, the
#: phone's bridge app on a node whose node config names one (``device-id``).
PHONE_CLIENT_APP = "android_bridge.bridge_app"


def write_app(app_dir: Path, run_config: Mapping[str, object], version: str = "1.0.0",
              client_module: str = "client.app") -> Path:
    """Write the app folder for ``run_config`` (flat dotted keys) and return it; its ClientApp
    is ``<client_module>:app``."""
    package = app_dir / APP_PACKAGE
    private_dir(package)
    lines = [
        "[build-system]",
        'requires = ["setuptools>=68"]',
        'build-backend = "setuptools.build_meta"',
        "",
        "[project]",
        'name = "fedgc-deploy-app"',
        f'version = "{version}"',
        'description = "fedgc ServerApp and ClientApp (DGC) on the deployment engine"',
        'license = "Apache-2.0"',
        "dependencies = []",
        "",
        "[tool.flwr.app]",
        'publisher = "fedgc"',
        "",
        "[tool.flwr.app.components]",
        f'serverapp = "{APP_PACKAGE}.server_app:app"',
        f'clientapp = "{APP_PACKAGE}.client_app:app"',
        "",
        "[tool.flwr.app.config]",
    ]
    for key in sorted(run_config):
        # Quoted keys keep dotted names ("dgc.density") flat, exactly as RunConfig reads them.
        lines.append(f"{json.dumps(key)} = {toml_value(key, run_config[key])}")
    (app_dir / "pyproject.toml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (package / "__init__.py").write_text('"""fedgc on the deployment engine."""\n')
    (package / "server_app.py").write_text(
        '"""Re-export of the fedgc ServerApp."""\n\nfrom server.app import app\n\n'
        '__all__ = ["app"]\n'
    )
    (package / "client_app.py").write_text(
        f'"""Re-export of the fedgc ClientApp."""\n\nfrom {client_module} import app\n\n'
        '__all__ = ["app"]\n'
    )
    return app_dir
