"""te_parallel.native is the only door to the compiled extension, and its code tables are the extension's.

1. No module of te_parallel outside te_parallel/native/ imports te_parallel._C, or asks te_parallel.native
   for the extension module itself (load(), require(), _module): everything else calls the family
   modules' checked wrappers and asks their `usable` predicates.
2. The Python code tables (te_parallel.native.DTYPES, ACTIVATIONS, GATED_ACTIVATIONS, NORM_TYPES,
   AMAX_ALGOS) are exactly what the extension exports, and name what the Python side knows: torch's
   dtypes, TE's activations (gated ones as ops.activation has them), the recipe's amax algorithms.
"""
import ast
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import te_parallel
from te_parallel import native
from te_parallel.ops import activation as act_ops

PACKAGE = Path(te_parallel.__file__).resolve().parent
EXTENSION = "te_parallel._C"
NATIVE = "te_parallel.native"
DOOR_NAMES = {"load", "require", "_module"}  # what hands out the extension module itself


def door_violations(source: str, filename: str = "<string>") -> list:
    """'file:line: what' for each place in `source` that reaches the extension other than through
    te_parallel.native's family modules."""
    tree = ast.parse(source, filename)
    found = []
    native_aliases = set()  # names bound to the te_parallel.native package
    door_aliases = set()    # names bound to its load / require / _module

    def flag(node, what):
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == EXTENSION or alias.name.startswith(EXTENSION + "."):
                    flag(node, f"import {alias.name}")
                if alias.name == NATIVE and alias.asname:
                    native_aliases.add(alias.asname)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            for alias in node.names:
                if module == EXTENSION or module.startswith(EXTENSION + ".") or (module == "te_parallel"
                                                                               and alias.name == "_C"):
                    flag(node, f"from {module} import {alias.name}")
                if module == "te_parallel" and alias.name == "native":
                    native_aliases.add(alias.asname or "native")
                if module == NATIVE and alias.name in DOOR_NAMES:
                    door_aliases.add(alias.asname or alias.name)
                    flag(node, f"from {NATIVE} import {alias.name}")
        elif isinstance(node, ast.Call):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and arg.value == EXTENSION:
                    flag(node, f"a call with {EXTENSION!r} (importlib?)")
            if isinstance(node.func, ast.Name) and node.func.id in door_aliases:
                flag(node, f"{node.func.id}()")
    for node in ast.walk(tree):  # attribute uses, once every alias is known
        if isinstance(node, ast.Attribute) and node.attr in DOOR_NAMES:
            base = node.value
            if isinstance(base, ast.Name) and base.id in native_aliases:
                flag(node, f"{base.id}.{node.attr}")
            elif ast.unparse(base) == NATIVE:
                flag(node, f"{NATIVE}.{node.attr}")
    return found


def _outside_native():
    for path in sorted(PACKAGE.rglob("*.py")):
        if PACKAGE / "native" not in path.parents:
            yield path


def test_no_module_outside_native_reaches_the_extension():
    files = list(_outside_native())
    assert len(files) > 20 and PACKAGE / "ops" / "norm.py" in files  # the scan sees the package
    found = [v for path in files for v in door_violations(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not found, "te_parallel._C reached outside te_parallel/native/:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    "import te_parallel._C",
    "import te_parallel._C as C",
    "from te_parallel import _C",
    "from te_parallel._C import reduce_sum",
    "import importlib\nC = importlib.import_module('te_parallel._C')",
    "from te_parallel import native\nC = native.load()",
    "from te_parallel import native as n\nn.require('x', 'cast').gemm()",
    "from te_parallel.native import load\nload()",
    "from te_parallel.native import load as get\nget().reduce_sum([], 0, 0, 0, 0, 0)",
    "import te_parallel.native\nte_parallel.native.load()",
    "import te_parallel.native as tn\ntn._module.gemm()",
])
def test_the_door_check_catches(source):
    assert door_violations(source), source


@pytest.mark.parametrize("source", [
    "from te_parallel import native\nnative.available()",
    "from te_parallel.native import cast as native_cast\nnative_cast.usable(x)",
    "from te_parallel.native import gemm\ngemm.usable()",
    "x = 'te_parallel._C is absent (built without nvcc)'",
    "def load():\n    pass\nload()",
])
def test_the_door_check_lets_through(source):
    assert not door_violations(source), source


@pytest.fixture
def extension():
    module = native.load()
    if module is None:
        pytest.skip("te_parallel._C is absent (built without nvcc): no tables to compare")
    return module


def test_dtype_codes_are_the_extensions(extension):
    assert native.DTYPES == {getattr(torch, name): code for name, code in extension.DTYPES.items()}
    assert set(native.DTYPES) == set(native.HIGH_PRECISION_DTYPES) | set(native.FP8_DTYPES)
    assert len(set(native.DTYPES.values())) == len(native.DTYPES)  # one code per dtype


def test_activation_codes_and_gatedness_are_the_extensions(extension):
    assert native.ACTIVATIONS == dict(extension.ACTIVATIONS)
    assert native.GATED_ACTIVATIONS == {n for n, c in extension.ACTIVATIONS.items() if extension.activation_is_gated(c) == 1}
    assert set(native.ACTIVATIONS) == set(act_ops.ACTIVATIONS)  # TE's names, every one with a kernel
    assert native.GATED_ACTIVATIONS == {n for n in act_ops.ACTIVATIONS if act_ops.is_gated(n)}
    assert extension.activation_is_gated(max(native.ACTIVATIONS.values()) + 1) == -1


def test_norm_and_amax_codes_are_the_extensions(extension):
    assert native.NORM_TYPES == dict(extension.NORM_TYPES) and set(native.NORM_TYPES) == {"layer_norm", "rms_norm"}
    assert native.NORM_TYPES == {"layer_norm": extension.LAYERNORM, "rms_norm": extension.RMSNORM}
    assert native.AMAX_ALGOS == dict(extension.AMAX_ALGOS) and set(native.AMAX_ALGOS) == {"max", "most_recent"}


def test_an_extension_without_the_tables_is_not_used(monkeypatch):
    """A stale build (from before the tables) must not be trusted with codes: load() refuses it, warns,
    and leaves the tables as they were."""
    stale = types.ModuleType("te_parallel._C")
    stale.gemm = lambda *a: None
    before = (dict(native.DTYPES), dict(native.ACTIVATIONS))
    monkeypatch.setitem(sys.modules, "te_parallel._C", stale)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_load_attempted", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.load() is None and not native.available()
    messages = [str(w.message) for w in caught if issubclass(w.category, native.NativeKernelsAbsentWarning)]
    assert len(messages) == 1 and "has no DTYPES, ACTIVATIONS, NORM_TYPES, AMAX_ALGOS" in messages[0], messages
    assert (native.DTYPES, native.ACTIVATIONS) == before
