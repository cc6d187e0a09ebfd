"""Security defaults: no pickle anywhere in the services, loopback by default."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_no_pickle_in_services_or_shared():
    for path in [*REPO.glob("services/**/*.py"), *REPO.glob("shared/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] in ("pickle", "cloudpickle", "dill") for n in names), path


def test_http_binds_loopback_by_default():
    from services.launcher import build_parser

    assert importlib.import_module("services.api.__main__").build_parser().parse_args([]).host == "127.0.0.1"
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"
