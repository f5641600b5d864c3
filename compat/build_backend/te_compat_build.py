"""setuptools' build backend, refusing to build (and so to install) over NVIDIA's Transformer Engine.

pip runs the build with the target environment's interpreter, so its site directories are where the
stand-in would be installed; if NVIDIA's TE is there, installing would shadow it.
"""
import importlib.util
import os
import sysconfig

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403

_HERE = os.path.dirname(os.path.abspath(__file__))


def _refuse_if_real_te() -> None:
    path = os.path.join(_HERE, "..", "transformer_engine", "_real_te.py")
    spec = importlib.util.spec_from_file_location("_te_compat_real_te", path)
    real_te = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real_te)
    paths = sysconfig.get_paths()
    found = real_te.find_real_te({paths["purelib"], paths["platlib"]})
    if found is not None:
        raise SystemExit(f"te_parallel's transformer_engine stand-in will not install over NVIDIA's Transformer Engine "
                         f"({found}); uninstall TE first or use a separate environment")


def get_requires_for_build_wheel(config_settings=None):
    _refuse_if_real_te()
    return _setuptools.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_editable(config_settings=None):
    _refuse_if_real_te()
    return _setuptools.get_requires_for_build_editable(config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _refuse_if_real_te()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _refuse_if_real_te()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
