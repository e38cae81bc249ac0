"""The real verl and SkyRL-gym tool classes, loaded from their PyPI wheels without torch, ray or pandas.

`pip download --no-deps` fetches the wheels (cached in `.cache/frameworks`); their tool modules are
imported unchanged from the unpacked wheels. Only the packages' `__init__` modules are bypassed (they
import the training stack): each package is registered as a plain namespace over its directory. The
one module of theirs that is not loaded is `verl.utils.ray_utils` (it imports ray), whose one
function the tool tracing uses is provided here.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import types
import zipfile
from importlib import import_module
from pathlib import Path

import pytest

VERL = "verl==0.9.1"
SKYRL_GYM = "skyrl-gym==0.4.0"
CACHE = Path(__file__).resolve().parents[1] / ".cache" / "frameworks"


def unpacked(requirement: str) -> Path:
    """The unpacked wheel of `requirement` (downloaded once)."""
    name, version = requirement.split("==")
    target = CACHE / f"{name}-{version}"
    if not (target / ".complete").exists():
        wheels = CACHE / "wheels"
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", requirement, "-d", str(wheels)],
                           check=True, capture_output=True, text=True, timeout=300)
        except subprocess.CalledProcessError as exc:
            pytest.fail(f"cannot download {requirement} from PyPI: {exc.stderr[-500:]}", pytrace=False)
        wheel = next(wheels.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(target)
        (target / ".complete").touch()
    return target


def _namespace(name: str, path: Path) -> None:
    if name in sys.modules:
        return
    module = types.ModuleType(name)
    module.__path__ = [str(path)]
    sys.modules[name] = module
    if "." in name:
        parent, child = name.rsplit(".", 1)
        setattr(sys.modules[parent], child, module)


def _current_loop() -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.get_event_loop_policy().get_event_loop()


def load_verl() -> Path:
    """Import verl's tool modules (base_tool, schemas, function_tool, tool_registry); its source root."""
    root = unpacked(VERL)
    for name in ("verl", "verl.utils", "verl.tools"):
        _namespace(name, root.joinpath(*name.split(".")))
    if "verl.utils.ray_utils" not in sys.modules:
        ray_utils = types.ModuleType("verl.utils.ray_utils")
        ray_utils.get_event_loop = _current_loop  # type: ignore[attr-defined]
        sys.modules["verl.utils.ray_utils"] = ray_utils
    for module in ("schemas", "base_tool", "function_tool", "tool_registry"):
        import_module(f"verl.tools.{module}")
    return root


def load_skyrl_gym() -> Path:
    """Import SkyRL-gym's Env, ToolGroup and BaseTextEnv; its source root."""
    root = unpacked(SKYRL_GYM)
    for name in ("skyrl_gym", "skyrl_gym.tools", "skyrl_gym.envs"):
        _namespace(name, root.joinpath(*name.split(".")))
    package = sys.modules["skyrl_gym"]
    core, error = import_module("skyrl_gym.core"), import_module("skyrl_gym.error")
    package.Env, package.error, package.core = core.Env, error, core  # type: ignore[attr-defined]
    for module in ("skyrl_gym.tools.core", "skyrl_gym.envs.base_text_env"):
        import_module(module)
    return root
