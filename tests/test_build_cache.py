"""setup.py's build cache: pip builds every install in fresh temporary directories, so a reinstall
of unchanged sources must find the extension in the per-user cache instead of compiling it again.

The keys are tested on a copy of csrc/ (no compiler runs: nvcc and torch are stand-ins); one test
builds a two-file extension for real with nvcc (a few seconds) to check that a cache hit compiles
nothing and that an edited file is the only one compiled again.
"""
import importlib.util
import os
import shutil
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_py():
    """setup.py as a module: its helpers, without running setup() (that runs only as __main__)."""
    spec = importlib.util.spec_from_file_location("te_parallel_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the file runs
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _fake_pybind11(monkeypatch, include: Path, version: str = "3.0.0") -> None:
    module = types.ModuleType("pybind11")
    module.__version__ = version
    module.get_include = lambda: str(include)
    monkeypatch.setitem(sys.modules, "pybind11", module)


def _fake_torch(root: Path, version: str) -> tuple[Path, Path]:
    (root / "include").mkdir(parents=True, exist_ok=True)
    (root / "lib").mkdir(exist_ok=True)
    (root / "version.py").write_text(f"__version__ = {version!r}\n")
    return root / "include", root / "lib"


@pytest.fixture
def checkout(setup_py, tmp_path, monkeypatch):
    """A copy of csrc/ as the project setup.py builds, with stand-ins for nvcc, pybind11 and torch."""
    project = tmp_path / "checkout"
    shutil.copytree(ROOT / "csrc", project / "csrc")
    monkeypatch.setattr(setup_py, "ROOT", project)
    monkeypatch.setattr(setup_py, "CSRC", project / "csrc")
    monkeypatch.setattr(setup_py, "find_nvcc", lambda: "/opt/cuda/bin/nvcc")
    torch = _fake_torch(tmp_path / "site-packages" / "torch", "2.13.0")
    monkeypatch.setattr(setup_py, "torch_dirs", lambda: torch)
    _fake_pybind11(monkeypatch, tmp_path / "pip-build-env-1" / "pybind11" / "include")
    monkeypatch.setattr(setup_py, "notice", lambda line: None)
    monkeypatch.setenv("TE_PARALLEL_CUDA_ARCHS", "90")
    monkeypatch.delenv("CXX", raising=False)
    return project


def _plan(setup_py, build_dir: Path):
    """The plan of one pip build: objects and extension in that build's own temporary directories."""
    return setup_py.plan_build(setup_py.native_extension(), build_dir / "build-temp",
                               build_dir / "build-lib" / "te_parallel" / "_C.cpython-311-x86_64-linux-gnu.so")


def _keys(plan) -> dict:
    return {unit.name: unit.key for unit in plan.units}


def test_identical_builds_in_fresh_directories_share_keys(setup_py, checkout, tmp_path, monkeypatch):
    first = _plan(setup_py, tmp_path / "tmp-a")
    # a second isolated pip build: new temporary dirs, pybind11 in a new build environment
    _fake_pybind11(monkeypatch, tmp_path / "pip-build-env-2" / "pybind11" / "include")
    second = _plan(setup_py, tmp_path / "tmp-b")
    assert _keys(second) == _keys(first) and second.key == first.key
    assert {u.part for u in first.units} == set(setup_py.Part)
    assert len(set(_keys(first).values())) == len(first.units)  # one entry per file

    other = tmp_path / "elsewhere"  # another checkout: torch's macros embed its path (__FILE__)
    shutil.copytree(checkout / "csrc", other / "csrc")
    monkeypatch.setattr(setup_py, "ROOT", other)
    monkeypatch.setattr(setup_py, "CSRC", other / "csrc")
    assert _plan(setup_py, tmp_path / "tmp-c").key != first.key


def test_an_edited_source_changes_its_own_key_and_the_extension_key(setup_py, checkout, tmp_path):
    before = _plan(setup_py, tmp_path / "tmp-a")
    with open(checkout / "csrc" / "kernels" / "norm.cu", "a") as f:
        f.write("\n// edited\n")
    after = _plan(setup_py, tmp_path / "tmp-b")
    changed = {name for name, key in _keys(after).items() if key != _keys(before)[name]}
    assert changed == {"kernels/norm.cu"}
    assert after.key != before.key


def test_an_edited_header_changes_every_key(setup_py, checkout, tmp_path):
    before = _plan(setup_py, tmp_path / "tmp-a")
    with open(checkout / "csrc" / "kernels" / "norm_common.cuh", "a") as f:
        f.write("\n// edited\n")
    after = _plan(setup_py, tmp_path / "tmp-b")
    assert all(_keys(after)[name] != key for name, key in _keys(before).items())


@pytest.mark.parametrize("change, parts", [
    ("archs", {"CUDA", "BINDING"}),    # gencode flags; the binding reports the built archs
    ("nvcc", {"CUDA"}),
    ("nvcc_flags", {"CUDA"}),          # NVCC_APPEND_FLAGS reaches every nvcc call
    ("torch", {"TORCH_OP"}),           # a new torch recompiles only the ops against its headers
    ("pybind11", {"BINDING"}),
    ("cxx", {"CUDA", "BINDING", "TORCH_OP"}),
])
def test_flags_and_tool_versions_are_in_the_key(setup_py, checkout, tmp_path, monkeypatch, change, parts):
    before = _plan(setup_py, tmp_path / "tmp-a")
    if change == "archs":
        monkeypatch.setenv("TE_PARALLEL_CUDA_ARCHS", "89;90")
    elif change == "nvcc":
        real = setup_py.tool_version
        monkeypatch.setattr(setup_py, "tool_version",
                            lambda *tool: "nvcc 99.0" if tool[0].endswith("nvcc") else real(*tool))
    elif change == "nvcc_flags":
        monkeypatch.setenv("NVCC_APPEND_FLAGS", "-lineinfo")
    elif change == "torch":
        torch = _fake_torch(tmp_path / "site-packages" / "torch", "2.14.0")
        monkeypatch.setattr(setup_py, "torch_dirs", lambda: torch)
    elif change == "pybind11":
        _fake_pybind11(monkeypatch, tmp_path / "pip-build-env-1" / "pybind11" / "include", version="3.1.0")
    elif change == "cxx":
        monkeypatch.setenv("CXX", "clang++")
    after = _plan(setup_py, tmp_path / "tmp-b")
    changed = {u.part.name for u, b in zip(after.units, before.units) if u.key != b.key}
    assert changed == parts
    assert after.key != before.key


def test_cache_dir_follows_xdg_and_the_switch(setup_py, tmp_path, monkeypatch):
    monkeypatch.delenv("TE_PARALLEL_BUILD_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert setup_py.build_cache_dir() == tmp_path / "te_parallel" / "build"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec says to ignore it
    assert setup_py.build_cache_dir() == Path.home() / ".cache" / "te_parallel" / "build"
    monkeypatch.setenv("TE_PARALLEL_BUILD_CACHE", "0")
    assert setup_py.build_cache_dir() is None
    assert not setup_py.BuildCache(None).fetch("0" * 64, tmp_path / "x.o")


def test_cache_fetch_store_and_prune(setup_py, tmp_path):
    cache = setup_py.BuildCache(tmp_path / "cache")
    src = tmp_path / "a.o"
    src.write_bytes(b"object")
    key = "ab" * 32
    assert not cache.fetch(key, tmp_path / "out" / "a.o")
    cache.store(key, src)
    assert cache.fetch(key, tmp_path / "out" / "a.o")
    assert (tmp_path / "out" / "a.o").read_bytes() == b"object"
    assert sorted(p.name for p in (tmp_path / "cache").rglob("*")) == ["ab", key + ".o"]  # no temporary left

    older = "cd" * 32
    cache.store(older, src)
    os.utime(tmp_path / "cache" / "cd" / (older + ".o"), (0, 0))
    cache.prune(max_bytes=len(b"object"))  # room for one entry: the least recently used goes
    assert cache.fetch(key, tmp_path / "b.o") and not cache.fetch(older, tmp_path / "c.o")


TINY_KERNEL = "__global__ void tiny_kernel(float* x) { x[threadIdx.x] *= 2.0f; }\n"
TINY_BINDING = "int tiny_binding() { return 1; }\n"


@pytest.mark.skipif(shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").is_file(),
                    reason="nvcc is not installed: the build cache is only used for native builds")
def test_a_cache_hit_compiles_nothing(setup_py, tmp_path, monkeypatch):
    """Builds a two-file extension three times, as three pip runs would (fresh build dirs each time)."""
    project = tmp_path / "checkout"
    (project / "csrc" / "kernels").mkdir(parents=True)
    (project / "csrc" / "bindings").mkdir()
    (project / "csrc" / "kernels" / "tiny.cu").write_text(TINY_KERNEL)
    (project / "csrc" / "bindings" / "tiny.cpp").write_text(TINY_BINDING)
    monkeypatch.setattr(setup_py, "ROOT", project)
    monkeypatch.setattr(setup_py, "CSRC", project / "csrc")
    _fake_pybind11(monkeypatch, tmp_path / "pybind11" / "include")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TE_PARALLEL_CUDA_ARCHS", "90")
    monkeypatch.setenv("MAX_JOBS", "2")
    for var in ("TE_PARALLEL_BUILD_CACHE", "CXX", "NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"):
        monkeypatch.delenv(var, raising=False)
    lines, commands = [], []
    monkeypatch.setattr(setup_py, "notice", lines.append)
    real_run = setup_py.run_command
    monkeypatch.setattr(setup_py, "run_command", lambda cmd: commands.append(cmd) or real_run(cmd))
    ext = setup_py.Extension("tiny._C", sources=["csrc/kernels/tiny.cu", "csrc/bindings/tiny.cpp"], depends=[])

    def build(run: str) -> bytes:
        lines.clear(), commands.clear()
        out = tmp_path / run / "build-lib" / "_C.so"
        setup_py.build_native(ext, tmp_path / run / "build-temp", out)
        return out.read_bytes()

    first = build("run1")
    assert len(commands) == 3, commands  # two compiles and the link
    assert lines[0].startswith("te_parallel: compiling te_parallel._C: 1 CUDA kernel file (nvcc, sm_90), "
                               "1 pybind11 binding file (C++); 2 compiler jobs, roughly 1 minute"), lines
    assert sorted(line.split("] ")[1].split(" in ")[0] for line in lines[1:3]) == [
        "compiled bindings/tiny.cpp", "compiled kernels/tiny.cu"]
    assert "; cached (key " in lines[-1]

    assert build("run2") == first
    assert commands == []
    assert len(lines) == 1 and lines[0].startswith("te_parallel: reused cached build (key "), lines

    (project / "csrc" / "bindings" / "tiny.cpp").write_text(TINY_BINDING + "int tiny_two() { return 2; }\n")
    build("run3")
    assert [Path(c[0]).name for c in commands] == ["c++", "nvcc"]  # the edited file and the link
    assert "1 more reused from the build cache" in lines[0], lines
