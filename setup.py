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

Build cache. pip builds every install in fresh temporary directories, so nothing of an earlier build is
found there. Each compiled object and the linked extension are therefore kept in a per-user cache,
$XDG_CACHE_HOME/te_parallel/build (~/.cache/te_parallel/build by default), under a hash of everything
that decides their bytes: the compiler command (flags, architectures, defines), the source, every header
under csrc/, the nvcc and host compiler versions, and pybind11's and Python's version (the binding) or
torch's (the torch ops). Paths that differ between otherwise identical builds are not part of it: pip's
temporary build directories, and pybind11's, which sits in a new isolated build environment each time
(its version stands for it; the paths its asserts embed point into a deleted directory either way). The
checkout's path and torch's are part of it (torch's macros embed __FILE__). Reinstalling unchanged
sources copies the cached extension and compiles nothing; changing one .cu file recompiles that file
alone; changing a header recompiles everything. The least recently used entries beyond CACHE_MAX_BYTES
are deleted.

What the build prints, on stderr (pip shows it with -v, or when the build fails; pip without -v hides
it, so the same lines also go to the terminal, /dev/tty, when there is one): before compiling, the
parts, file counts, architectures and a time estimate; one line per finished file with its time; the
link; or, when nothing changed, "reused cached build (key ...)".

Build-time switches (environment):
  TE_PARALLEL_CUDA_ARCHS   "89;90;100" by default; ';' or ',' separated; "90a", "sm_90", "9.0" accepted.
                           SASS for each, plus PTX of the highest for newer GPUs.
  TE_PARALLEL_SKIP_NATIVE  "1": build no extension.
  TE_PARALLEL_BUILD_CACHE  "0": neither reuse nor keep compiled files (XDG_CACHE_HOME moves the cache).
  MAX_JOBS                 parallel compiler processes (default min(4, CPU count)).
  CUDA_HOME / CUDA_PATH    where to look for bin/nvcc before PATH and /usr/local/cuda/bin.
  CXX                      host C++ compiler (default c++); also given to nvcc as -ccbin.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
DEFAULT_ARCHS = "89;90;100"  # Ada (first FP8 GPUs), Hopper, Blackwell; all accepted by nvcc 13.0
TORCH_TARGET = "0x020b000000000000"  # torch 2.11: the oldest torch whose stable ABI the ops may use
_ARCH_RE = re.compile(r"^(\d{2,3})([af]?)$")

CACHE_FORMAT = "te_parallel build cache 1"  # part of every key: change it when what an entry holds changes
CACHE_MAX_BYTES = 2 << 30  # an sm_90 build keeps about 12 MB
# Seconds one compiler job takes, for the estimate printed before compiling: nvcc per file and
# architecture, the host compiler per file (measured with nvcc 13.0 and g++ 12 on a 2-core machine).
SECONDS_PER_CUDA_FILE_ARCH = 14.0
SECONDS_PER_HOST_FILE = 15.0


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


def duration(seconds: float) -> str:
    """41 s, 2 min 05 s."""
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


# ---- the build cache --------------------------------------------------------------------------------

def build_cache_dir() -> Path | None:
    """$XDG_CACHE_HOME/te_parallel/build (~/.cache/... when unset or relative, as the XDG spec says);
    None when TE_PARALLEL_BUILD_CACHE=0."""
    if os.environ.get("TE_PARALLEL_BUILD_CACHE", "").strip().lower() in ("0", "false", "no", "off"):
        return None
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "te_parallel" / "build"


def digest(*parts: str | bytes) -> str:
    """sha256 of the parts, each prefixed by its length so that no two lists of parts collide."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def files_digest(paths: list[Path]) -> str:
    """Names (relative to the project) and contents of `paths`."""
    return digest(*[part for p in sorted(paths) for part in (p.relative_to(ROOT).as_posix(), p.read_bytes())])


@functools.lru_cache(maxsize=None)
def tool_version(*tool: str) -> str:
    """What `tool --version` prints (release and build): the compiler's identity in a cache key. `tool`
    is a command, so that CXX="ccache g++" reports g++."""
    try:
        return subprocess.run([*tool, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, check=False).stdout
    except OSError as err:
        return f"{' '.join(tool)}: {err.strerror}"


def nvcc_identity(nvcc: str, cxx: list[str]) -> tuple[str, ...]:
    """nvcc, the host compiler it runs (-ccbin with CXX, else gcc from PATH or NVCC_CCBIN), and the
    environment variables through which nvcc reads more flags."""
    env = [f"{var}={os.environ.get(var, '')}" for var in ("NVCC_CCBIN", "NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")]
    host = cxx[0] if "CXX" in os.environ else os.environ.get("NVCC_CCBIN") or "gcc"
    return (tool_version(nvcc), tool_version(host), *env)


def command_key(cmd: list[str], stand_ins: dict[str, str], *inputs: str | bytes) -> str:
    """Cache key of a compiler or linker call: the command, with `stand_ins` (in order) replacing paths
    that change between identical builds, plus the `inputs` it reads (sources, header digest, versions)."""
    text = "\0".join(cmd)
    for path, stand_in in stand_ins.items():
        text = text.replace(path, stand_in)
    return digest(CACHE_FORMAT, text, *inputs)


class BuildCache:
    """Files by key, under `root` (None: keeps nothing). An entry is written under a temporary name and
    renamed, so concurrent builds never see half a file; a cache that cannot be written costs a
    rebuild next time, never a failed build."""

    def __init__(self, root: Path | None):
        self.root = root

    def _entry(self, key: str, suffix: str) -> Path:
        return self.root / key[:2] / (key + suffix)

    def fetch(self, key: str, dest: Path) -> bool:
        """Copies the entry `key` to `dest`; False if there is none."""
        if self.root is None or not self._entry(key, dest.suffix).is_file():
            return False
        try:
            copy_atomic(self._entry(key, dest.suffix), dest)
            os.utime(self._entry(key, dest.suffix))  # recently used: prune() keeps it longest
        except OSError:
            return False
        return True

    def store(self, key: str, src: Path) -> None:
        if self.root is None:
            return
        try:
            copy_atomic(src, self._entry(key, src.suffix))
        except OSError as err:
            notice(f"te_parallel: cannot write the build cache {self.root} ({err.strerror}); building "
                   f"without it (the next install compiles again)")
            self.root = None

    def prune(self, max_bytes: int = CACHE_MAX_BYTES) -> None:
        """Deletes the least recently used entries beyond max_bytes."""
        if self.root is None:
            return
        try:
            entries = [(p.stat().st_mtime, p.stat().st_size, p) for p in self.root.glob("*/*")]
            total = 0
            for _, size, path in sorted(entries, reverse=True):
                total += size
                if total > max_bytes:
                    path.unlink(missing_ok=True)
        except OSError:
            pass  # another build pruned at the same time


def copy_atomic(src: Path, dest: Path) -> None:
    """Copies src over dest by a rename: a reader (or a process that has dest loaded) never sees half a file."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    os.close(fd)
    try:
        shutil.copy(src, tmp)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ---- what to compile --------------------------------------------------------------------------------

class Part(enum.Enum):
    """The parts of te_parallel._C, by what compiles them; the value names them in the progress lines."""
    CUDA = "CUDA kernel"            # csrc/**/*.cu, nvcc
    BINDING = "pybind11 binding"    # csrc/bindings/*.cpp, host compiler
    TORCH_OP = "torch-op"           # csrc/torch_ops/*.cpp, host compiler, torch's stable ABI headers


@dataclass(frozen=True)
class CompileUnit:
    """One compiler call: `cmd` compiles csrc/`name` into `obj`; the build cache keeps `obj` under `key`."""
    name: str
    part: Part
    obj: Path
    cmd: tuple[str, ...]
    key: str


@dataclass(frozen=True)
class BuildPlan:
    """Every compiler call, the link, and the key under which the cache keeps the linked extension."""
    archs: tuple[str, ...]
    units: tuple[CompileUnit, ...]
    link: tuple[str, ...]
    out: Path
    key: str


def compile_unit(part: Part, src: Path, obj_dir: Path, cmd: list[str], headers: str, *identity: str,
                 stand_ins: dict[str, str] | None = None) -> CompileUnit:
    """`cmd` plus `-c src -o obj`, keyed by the command (with the object's path and `stand_ins` replaced),
    the source, the headers' digest and the `identity` of the tools and libraries."""
    obj = obj_dir / (src.relative_to(CSRC).as_posix().replace("/", "_") + ".o")
    cmd = [*cmd, "-c", str(src), "-o", str(obj)]
    key = command_key(cmd, {str(obj): "<obj>", **(stand_ins or {})}, src.read_bytes(), headers, *identity)
    return CompileUnit(src.relative_to(CSRC).as_posix(), part, obj, tuple(cmd), key)


def cuda_unit(nvcc: str, cxx: list[str], archs: list[str], src: Path, obj_dir: Path, headers: str) -> CompileUnit:
    cmd = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
           f"-I{CSRC / 'include'}", *gencode_flags(archs)]
    if "CXX" in os.environ:
        cmd += ["-ccbin", cxx[0]]
    return compile_unit(Part.CUDA, src, obj_dir, cmd, headers, *nvcc_identity(nvcc, cxx))


def binding_unit(cxx: list[str], archs: list[str], src: Path, obj_dir: Path, headers: str) -> CompileUnit:
    import pybind11  # build requirement; imported here so the no-nvcc path never needs it

    py_includes = {sysconfig.get_paths()["include"], sysconfig.get_paths()["platinclude"]}
    cmd = [*cxx, "-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden",
           f"-DTEP_BUILT_ARCHS=\"{';'.join(archs)}\"", f"-I{CSRC / 'include'}", f"-I{pybind11.get_include()}",
           *[f"-I{p}" for p in sorted(py_includes)]]
    # pybind11 sits in a new temporary directory in each isolated build: its version stands for its path
    return compile_unit(Part.BINDING, src, obj_dir, cmd, headers, tool_version(*cxx), sys.version,
                        stand_ins={pybind11.get_include(): f"<pybind11 {pybind11.__version__}>"})


def torch_unit(cxx: list[str], src: Path, obj_dir: Path, headers: str, torch_include: Path) -> CompileUnit:
    cmd = [*cxx, "-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden",
           f"-DTORCH_TARGET_VERSION={TORCH_TARGET}", f"-I{CSRC / 'include'}", f"-I{torch_include}"]
    return compile_unit(Part.TORCH_OP, src, obj_dir, cmd, headers, tool_version(*cxx), torch_version(torch_include))


def torch_version(torch_include: Path) -> str:
    """torch/version.py (release, git commit, CUDA version) of the torch whose headers are used."""
    version_py = torch_include.parent / "version.py"
    return version_py.read_text() if version_py.is_file() else "torch version unknown"


def plan_build(ext: Extension, obj_dir: Path, out: Path) -> BuildPlan:
    """What building `ext` into `out` compiles (objects in obj_dir) and links, with the cache keys."""
    nvcc = find_nvcc()
    archs = parse_archs(os.environ.get("TE_PARALLEL_CUDA_ARCHS", DEFAULT_ARCHS))
    cxx = shlex.split(os.environ.get("CXX", "c++"))
    headers = files_digest([ROOT / d for d in ext.depends])  # every header, for every file: nothing missed
    sources = [ROOT / s for s in ext.sources]
    ops = [s for s in sources if s.parent.name == "torch_ops"]
    torch = torch_dirs() if ops else None
    if ops and torch is None:
        notice("te_parallel: torch's headers were not found at build time; building without the torch custom "
               "ops (C++ host path). Install torch first, then te_parallel, to get them")
    units = [cuda_unit(nvcc, cxx, archs, s, obj_dir, headers) for s in sources if s.suffix == ".cu"]
    bindings = [s for s in sources if s.suffix == ".cpp" and s not in ops]
    units += [binding_unit(cxx, archs, s, obj_dir, headers) for s in bindings]
    if torch is not None:
        units += [torch_unit(cxx, s, obj_dir, headers, torch[0]) for s in ops]
    # nvcc as the linker driver adds the static cudart and its system libraries (-ldl -lrt
    # -lpthread) itself; --exclude-libs keeps cudart's symbols private to this .so, so they never
    # interpose with (or get interposed by) the libcudart.so that torch loads globally.
    link = [nvcc, "-shared", "-cudart", "static", "-o", str(out), *[str(u.obj) for u in units],
            "-Xlinker", "--exclude-libs,ALL"]
    if torch is not None:  # the stable ABI's C shim lives in libtorch_cpu (already loaded with torch)
        link += [f"-L{torch[1]}", "-ltorch_cpu", "-lc10", "-Xlinker", f"-rpath,{torch[1]}"]
    if "CXX" in os.environ:
        link[1:1] = ["-ccbin", cxx[0]]
    key = command_key(link, {str(out): out.name, **{str(u.obj): u.key for u in units}}, *nvcc_identity(nvcc, cxx))
    return BuildPlan(tuple(archs), tuple(units), tuple(link), out, key)


# ---- running it -------------------------------------------------------------------------------------

def build_native(ext: Extension, obj_dir: Path, out: Path) -> None:
    """Builds `ext` into `out`: from the cache when it holds the same build, else compiling the files
    the cache lacks and linking; says what it does on stderr."""
    start = time.monotonic()
    plan = plan_build(ext, obj_dir, out)
    cache = BuildCache(build_cache_dir())
    archs = "sm_" + ", sm_".join(plan.archs)
    if cache.fetch(plan.key, out):
        notice(f"te_parallel: reused cached build (key {plan.key[:12]}) of {out.name} for {archs} from "
               f"{cache.root}: sources, flags and compilers unchanged, nothing compiled")
        return
    obj_dir.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    todo = [u for u in plan.units if not cache.fetch(u.key, u.obj)]
    jobs = max(1, min(max_jobs(), len(todo)))
    notice(build_notice(plan, todo, jobs, cache.root))
    compile_units(todo, jobs, cache)
    link_start = time.monotonic()
    run_command(list(plan.link))
    cache.store(plan.key, out)
    cache.prune()
    kept = f"; cached (key {plan.key[:12]}) in {cache.root}" if cache.root else ""
    notice(f"te_parallel: linked {out.name} in {duration(time.monotonic() - link_start)}; built for {archs} "
           f"in {duration(time.monotonic() - start)}{kept}")


def build_notice(plan: BuildPlan, todo: list[CompileUnit], jobs: int, cache_root: Path | None) -> str:
    """The line before compiling: which parts, how many files, which architectures, roughly how long."""
    if not todo:
        return (f"te_parallel: all {len(plan.units)} files of te_parallel._C (sm_{', sm_'.join(plan.archs)}) "
                f"are in the build cache {cache_root}; linking them")
    count = {part: sum(u.part is part for u in todo) for part in Part}
    tools = {Part.CUDA: f"nvcc, sm_{', sm_'.join(plan.archs)}", Part.BINDING: "C++", Part.TORCH_OP: "C++"}
    parts = ", ".join(f"{count[part]} {part.value} file{'s' if count[part] > 1 else ''} ({tools[part]})"
                      for part in Part if count[part])
    seconds = (count[Part.CUDA] * len(plan.archs) * SECONDS_PER_CUDA_FILE_ARCH
               + (count[Part.BINDING] + count[Part.TORCH_OP]) * SECONDS_PER_HOST_FILE) / jobs
    minutes = max(1, round(seconds / 60))
    reused = len(plan.units) - len(todo)
    line = (f"te_parallel: compiling te_parallel._C: {parts}"
            f"{f'; {reused} more reused from the build cache' if reused else ''}; {jobs} compiler "
            f"job{'s' if jobs > 1 else ''}, roughly {minutes} minute{'s' if minutes > 1 else ''} "
            f"(longer on a busy machine).")
    if cache_root is not None:
        line += f" The result is cached in {cache_root}: reinstalling unchanged sources takes seconds."
    return (line + " Build only your GPU's architecture with TE_PARALLEL_CUDA_ARCHS=90 (H100/H200; 89 Ada, "
            "100 Blackwell), or none with TE_PARALLEL_SKIP_NATIVE=1 (pure PyTorch)")


def compile_units(units: list[CompileUnit], jobs: int, cache: BuildCache) -> None:
    """Runs the compiler calls `jobs` at a time; keeps each object in the cache and says when it is done."""
    start = time.monotonic()
    pool = ThreadPoolExecutor(max_workers=jobs)
    futures = {pool.submit(run_command, list(u.cmd)): u for u in units}
    try:
        for done, future in enumerate(as_completed(futures), 1):
            unit = futures[future]
            seconds = future.result()  # re-raises a failed compile
            cache.store(unit.key, unit.obj)
            notice(f"te_parallel: [{done}/{len(units)}] compiled {unit.name} in {duration(seconds)} "
                   f"({duration(time.monotonic() - start)} elapsed)")
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def run_command(cmd: list[str]) -> float:
    """Runs cmd; prints what it printed (warnings) and returns the seconds it took. On failure, prints
    the command and its output and stops the build with one line."""
    start = time.monotonic()
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    if result.stdout:
        print(result.stdout, end="", flush=True)
    if result.returncode != 0:
        raise SystemExit(f"te_parallel: {Path(cmd[0]).name} failed with exit code {result.returncode} "
                         f"(its command and output are above)")
    return time.monotonic() - start


class NvccBuildExt(build_ext):
    """Compiles csrc/**/*.cu with nvcc and csrc/bindings/*.cpp with the host compiler, in parallel,
    and links them with cudart_static into te_parallel/_C*.so (the path setuptools asks for, so
    that --inplace and editable installs put it where `import te_parallel._C` finds it), reusing
    what the build cache holds."""

    def build_extension(self, ext: Extension) -> None:
        build_native(ext, Path(self.build_temp).resolve() / "te_parallel_C",
                     Path(self.get_ext_fullpath(ext.name)).resolve())


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


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import its helpers without building
    setup(
        ext_modules=[] if native_skip_reason() else [native_extension()],
        cmdclass={"build_ext": NvccBuildExt, "build_py": NoticeBuildPy},
    )
