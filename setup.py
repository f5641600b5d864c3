"""Build of te_parallel's native extension, te_parallel._C (metadata lives in pyproject.toml).

The kernels need no torch at build time: they take raw device pointers (csrc/include), and the
pybind11 binding passes them as integers. So the core of the build is nvcc + the host C++ compiler +
pybind11, and cudart is linked statically: `import te_parallel._C` then works on machines without a
GPU or a libcudart.so (CPU CI), and never depends on which CUDA runtime torch ships.

torch custom ops (csrc/torch_ops: the C++ host path and what torch.compile traces) are compiled into
the same extension when torch's headers are found: in the build environment, or in the environment
being installed into (so `pip install -e .` with build isolation finds the torch installed before it).
They use only torch's stable C++ ABI and target torch 2.11 (TORCH_TARGET_VERSION), so one build runs
on torch 2.11 and every later version. Without torch at build time they are left out (one line says
so) and te_parallel calls the kernels through the pybind11 binding alone.

Without nvcc (or with TE_PARALLEL_SKIP_NATIVE=1) no extension is built; te_parallel then runs on its
pure-PyTorch fallbacks (te_parallel/native/__init__.py warns once at run time).

Before compiling, the build says so on stderr (shown by `pip install -v`): which architectures, roughly
how long, and how to build fewer or none. pip without -v hides a build's output, so the same lines
also go to the terminal (/dev/tty) when there is one.

Build-time switches (environment):
  TE_PARALLEL_CUDA_ARCHS   "89;90;100" by default; ';' or ',' separated; "90a", "sm_90", "9.0" accepted.
                           SASS for each, plus PTX of the highest for newer GPUs.
  TE_PARALLEL_SKIP_NATIVE  "1": build no extension.
  MAX_JOBS                 parallel compiler processes (default min(4, CPU count)).
  CUDA_HOME / CUDA_PATH    where to look for bin/nvcc before PATH and /usr/local/cuda/bin.
  CXX                      host C++ compiler (default c++); also given to nvcc as -ccbin.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
DEFAULT_ARCHS = "89;90;100"
TORCH_TARGET = "0x020b000000000000"  # torch 2.11: the oldest torch whose stable ABI the ops may use  # Ada (first FP8 GPUs), Hopper, Blackwell; all accepted by nvcc 13.0
_ARCH_RE = re.compile(r"^(\d{2,3})([af]?)$")


def find_nvcc() -> str | None:
    """nvcc from CUDA_HOME/CUDA_PATH, then PATH, then /usr/local/cuda/bin; None if there is none."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def native_skip_reason() -> str | None:
    """Why no extension will be built, as the one line to print; None if it will be."""
    if os.environ.get("TE_PARALLEL_SKIP_NATIVE", "").strip().lower() in ("1", "true", "yes", "on"):
        return ("te_parallel: TE_PARALLEL_SKIP_NATIVE is set; installing the pure-PyTorch package "
                "without native kernels")
    if find_nvcc() is None:
        return ("te_parallel: nvcc not found; installing the pure-PyTorch package without native "
                "kernels")
    return None


def torch_dirs() -> tuple[Path, Path] | None:
    """(include dir, lib dir) of a torch whose stable C++ ABI headers exist: the build environment's, else
    the one in the site-packages of the environment being installed into (an isolated pip build keeps
    sys.prefix but hides that environment's packages from sys.path). None if there is none."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    paths = sysconfig.get_paths()
    roots += [Path(paths[key]) / "torch" for key in ("purelib", "platlib")]
    for root in roots:
        if (root / "include" / "torch" / "csrc" / "stable" / "library.h").is_file() and (root / "lib").is_dir():
            return root / "include", root / "lib"
    return None


def parse_archs(spec: str) -> list[str]:
    """'89;90a,sm_100' -> ['89', '90a', '100'] (sorted by number, deduplicated)."""
    archs: list[str] = []
    for token in re.split(r"[;,\s]+", spec.strip()):
        if not token:
            continue
        arch = token.lower().removeprefix("sm_").removeprefix("compute_").replace(".", "")
        if not _ARCH_RE.match(arch):
            raise SystemExit(f"te_parallel: TE_PARALLEL_CUDA_ARCHS has {token!r}; need entries like "
                             f"'90', '90a' or '9.0' separated by ';' or ','")
        if arch not in archs:
            archs.append(arch)
    if not archs:
        raise SystemExit(f"te_parallel: TE_PARALLEL_CUDA_ARCHS={spec!r} names no architecture")
    return sorted(archs, key=lambda a: (int(_ARCH_RE.match(a).group(1)), a))


def gencode_flags(archs: list[str]) -> list[str]:
    """SASS for every arch, and PTX of the highest so that newer GPUs can JIT it."""
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    flags.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    return flags


def max_jobs() -> int:
    value = os.environ.get("MAX_JOBS")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise SystemExit(f"te_parallel: MAX_JOBS={value!r}; need a positive integer")
        return int(value)
    return max(1, min(4, os.cpu_count() or 1))


def notice(message: str) -> None:
    """A line for the person installing: on stderr, and on the terminal when stderr is captured (pip)."""
    print(message, file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        return
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(f"\n{message}\n")
    except OSError:
        pass  # no terminal (CI, containers): stderr is all there is


def build_notice(archs: list[str], n_cuda: int, jobs: int) -> str:
    """What the build is about to do and roughly how long it takes (about a minute per architecture
    with two compiler jobs, measured on a 2-core machine)."""
    minutes = max(1, round(2 * len(archs) / jobs))
    return (f"te_parallel: compiling {n_cuda} CUDA kernel files with nvcc for sm_{', sm_'.join(archs)} "
            f"({jobs} compiler jobs): roughly {minutes} minute{'s' if minutes > 1 else ''}. Build only your GPU's "
            f"architecture with TE_PARALLEL_CUDA_ARCHS=90 (H100/H200; 89 Ada, 100 Blackwell), or none with "
            f"TE_PARALLEL_SKIP_NATIVE=1 (pure PyTorch)")


def run_command(cmd: list[str]) -> None:
    print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.stdout:
        print(result.stdout, end="", flush=True)
    if result.returncode != 0:
        raise SystemExit(f"te_parallel: command failed with exit code {result.returncode}: {cmd[0]}")


class NvccBuildExt(build_ext):
    """Compiles csrc/**/*.cu with nvcc and csrc/bindings/*.cpp with the host compiler, in parallel,
    and links them with cudart_static into te_parallel/_C*.so (the path setuptools asks for, so
    that --inplace and editable installs put it where `import te_parallel._C` finds it)."""

    def build_extension(self, ext: Extension) -> None:
        start = time.monotonic()
        nvcc = find_nvcc()
        archs = parse_archs(os.environ.get("TE_PARALLEL_CUDA_ARCHS", DEFAULT_ARCHS))
        cxx = shlex.split(os.environ.get("CXX", "c++"))
        obj_dir = Path(self.build_temp).resolve() / "te_parallel_C"
        obj_dir.mkdir(parents=True, exist_ok=True)
        sources = [ROOT / s for s in ext.sources]
        notice(build_notice(archs, sum(s.suffix == ".cu" for s in sources), max_jobs()))
        jobs = [self._nvcc_job(nvcc, cxx, archs, s, obj_dir) for s in sources if s.suffix == ".cu"]
        torch = torch_dirs()
        ops = [s for s in sources if s.parent.name == "torch_ops"]
        if ops and torch is None:
            notice("te_parallel: torch's headers were not found at build time; building without the torch custom "
                   "ops (C++ host path). Install torch first, then te_parallel, to get them")
        jobs += [self._cxx_job(cxx, archs, s, obj_dir) for s in sources if s.suffix == ".cpp" and s not in ops]
        if torch is not None:
            jobs += [self._torch_job(cxx, s, obj_dir, torch[0]) for s in ops]
        with ThreadPoolExecutor(max_workers=max_jobs()) as pool:
            list(pool.map(run_command, [cmd for cmd, _ in jobs]))  # list(): re-raise failures
        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        # nvcc as the linker driver adds the static cudart and its system libraries (-ldl -lrt
        # -lpthread) itself; --exclude-libs keeps cudart's symbols private to this .so, so they never
        # interpose with (or get interposed by) the libcudart.so that torch loads globally.
        link = [nvcc, "-shared", "-cudart", "static", "-o", str(out), *[str(o) for _, o in jobs],
                "-Xlinker", "--exclude-libs,ALL"]
        if torch is not None and ops:  # the stable ABI's C shim lives in libtorch_cpu (already loaded with torch)
            link += [f"-L{torch[1]}", "-ltorch_cpu", "-lc10", "-Xlinker", f"-rpath,{torch[1]}"]
        if "CXX" in os.environ:
            link[1:1] = ["-ccbin", cxx[0]]
        run_command(link)
        print(f"te_parallel: built {out.name} for sm_{', sm_'.join(archs)} "
              f"in {time.monotonic() - start:.1f} s", flush=True)

    @staticmethod
    def _nvcc_job(nvcc, cxx, archs, src: Path, obj_dir: Path):
        obj = obj_dir / (src.relative_to(CSRC).as_posix().replace("/", "_") + ".o")
        cmd = [nvcc, "-c", str(src), "-o", str(obj), "-O3", "-std=c++17",
               "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
               f"-I{CSRC / 'include'}", *gencode_flags(archs)]
        if "CXX" in os.environ:
            cmd += ["-ccbin", cxx[0]]
        return cmd, obj

    @staticmethod
    def _cxx_job(cxx, archs, src: Path, obj_dir: Path):
        import pybind11  # build requirement; imported here so the no-nvcc path never needs it

        obj = obj_dir / (src.relative_to(CSRC).as_posix().replace("/", "_") + ".o")
        py_includes = {sysconfig.get_paths()["include"], sysconfig.get_paths()["platinclude"]}
        cmd = [*cxx, "-c", str(src), "-o", str(obj), "-O3", "-std=c++17", "-fPIC",
               "-fvisibility=hidden", f"-DTEP_BUILT_ARCHS=\"{';'.join(archs)}\"",
               f"-I{CSRC / 'include'}", f"-I{pybind11.get_include()}",
               *[f"-I{p}" for p in sorted(py_includes)]]
        return cmd, obj


    @staticmethod
    def _torch_job(cxx, src: Path, obj_dir: Path, torch_include: Path):
        obj = obj_dir / (src.relative_to(CSRC).as_posix().replace("/", "_") + ".o")
        cmd = [*cxx, "-c", str(src), "-o", str(obj), "-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden",
               f"-DTORCH_TARGET_VERSION={TORCH_TARGET}", f"-I{CSRC / 'include'}", f"-I{torch_include}"]
        return cmd, obj


class NoticeBuildPy(build_py):
    """Prints the one line that says the native kernels are skipped (build_py runs once per build,
    editable or not; setup.py itself is run several times by pip)."""

    def run(self) -> None:
        reason = native_skip_reason()
        if reason:
            notice(reason)
        super().run()


def native_extension() -> Extension:
    """te_parallel._C from every csrc/**/*.cu plus the binding and the torch ops. Paths are relative to the project
    root (as setuptools wants them), which also puts sources and headers into an sdist."""

    def rel(pattern: str) -> list[str]:
        return sorted(p.relative_to(ROOT).as_posix() for p in CSRC.glob(pattern))

    sources = rel("**/*.cu") + rel("bindings/*.cpp") + rel("torch_ops/*.cpp")
    return Extension("te_parallel._C", sources=sources, depends=rel("**/*.h") + rel("**/*.cuh"))


setup(
    ext_modules=[] if native_skip_reason() else [native_extension()],
    cmdclass={"build_ext": NvccBuildExt, "build_py": NoticeBuildPy},
)
