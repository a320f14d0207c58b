"""The ``cpp`` backend: the primitives of ``kernels/primitives.py`` as C++ kernels from ``csrc/``.

The sources are the checkout's ``csrc/`` or, in an installed package, the copy the wheel carries
as ``astrai_kernels/csrc/`` (setup.py puts it there). The extension is built on first use with
``torch.utils.cpp_extension.load`` (ninja) into a per-user cache, never beside the sources: the
build directory is ``$ASTRAI_KERNELS_BUILD_DIR`` when set, else ``<cache>/cpp-<torch
version>-<hash>`` with ``<cache>`` the first of ``$TORCH_EXTENSIONS_DIR/astrai_kernels``,
``$XDG_CACHE_HOME/astrai_kernels`` and ``~/.cache/astrai_kernels``. The hash covers the sources'
contents, the flags, the compiler and the Python ABI, so a change to any of them builds afresh,
and an unchanged tree (a checkout or an installed copy of the same sources) loads the cached
library in well under a second. Flags are portable (``-O3 -fopenmp
-ffp-contract=fast``; no ``-march=native``, no ``-ffast-math``): the kernels carry AVX2 and
AVX-512 variants chosen at run time from the CPU's features (``ASTRAI_KERNELS_CPU_ISA`` =
``generic`` | ``avx2`` | ``avx512`` caps the choice).

A successful build leaves a ``<name>.complete`` marker holding the library's SHA-256; a
complete build is then imported directly, without ninja or the lock, so a directory that cannot
be written (a shared cache, a container image) serves too, and one that holds no complete build
is reported as such.

A wheel built with ``ASTRAI_KERNELS_PREBUILD=1`` (setup.py calls ``write_prebuilt``) carries the
library for the torch it was built against in ``astrai_kernels/prebuilt/`` with a manifest. It
is loaded, before any build directory is looked at, only when the manifest matches this process:
the torch version, the sources' hash (their contents and the flags), the instruction-set
architecture, the Python ABI and platform, and the library's SHA-256. A manifest that does not
match is said in one line on stderr, and the per-user build serves as without it.

A build (minutes: nothing is cached yet) says so on stderr as it starts, one line naming the
build directory and ``ASTRAI_KERNELS_BACKEND=torch`` to skip it, then a line per object file or
library ninja writes and the outcome; a cached library loads silently. ``astrai-kernels build``
does the build ahead of time.

Without a C++ compiler or ninja, ``unavailable_reason`` says so and a one-time warning names the
fallback (the ``torch`` backend); a failed build raises a ``RuntimeError`` carrying the compiler's
full output from ``load_extension()`` (and the primitives).
"""

import errno
import hashlib
import json
import os
import platform
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from .build import (
    COMPLETE_SUFFIX,
    LIB_SUFFIX,
    BuildFailed,
    BuildProgress,
    compiler,
    complete_library,
    failure_output,
    first_error_line,
    import_library,
    mark_complete,
    process_lock,
    say,
)

BUILD_DIR_ENV = "ASTRAI_KERNELS_BUILD_DIR"
ISA_ENV = "ASTRAI_KERNELS_CPU_ISA"
# setup.py's switch for a wheel carrying the library (it spells it too: it imports no package)
PREBUILD_ENV = "ASTRAI_KERNELS_PREBUILD"
PREBUILT_MANIFEST = "manifest.json"
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast")
LDFLAGS = ("-fopenmp",)
# Longest compile first (ninja starts them in this order, so the short ones fill in at the end):
# a cold build on the 2-core Intel Xeon took 84-88 s so, 97 s with sampling.cpp fifth
# (docs/install.md).
SOURCES = ("common.h", "sampling.cpp", "distill.cpp", "cross_entropy.cpp", "bindings.cpp",
           "grpo.cpp", "logprobs.cpp", "topk_distill.cpp", "row_topk.cpp", "vocab_shard.cpp")

_LOCK = threading.Lock()
_EXTENSION = None
_BUILD_ERROR = None  # the message of a failed build, kept so it is not retried in this process
_LOOKED_FOR_BUILD = False  # extension_if_built looked for a complete build on disk
_PREBUILT_REFUSAL_SAID = False
_WARNED = False


def source_dir():
    """The folder with the C++ sources, or None when it cannot be found: the installed package's
    own copy (``astrai_kernels/csrc``) first, else a checkout's ``csrc/`` beside the package."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "csrc", here.parents[3] / "csrc"):
        if all((candidate / name).is_file() for name in SOURCES):
            return candidate
    return None


def _toolchain_reason():
    """None when sources, compiler and ninja are present, else why the extension cannot build."""
    if source_dir() is None:
        return ("the cpp backend's C++ sources (csrc/) were not found next to the "
                "astrai_kernels package")
    if compiler() is None:
        wanted = f"$CXX={os.environ['CXX']!r}" if os.environ.get("CXX") else "c++ or g++"
        return f"no C++ compiler was found ({wanted} is not on PATH)"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja, which torch.utils.cpp_extension needs to build the cpp backend, is missing"
    return None


def _source_hash(src):
    """SHA-256 of the sources' names and contents and the flags (not their path: copies of the
    same sources, a checkout or an installed wheel, share one build)."""
    digest = hashlib.sha256()
    for name in sorted(SOURCES):  # their order is the build's, not part of what is built
        digest.update(name.encode())
        digest.update((src / name).read_bytes())
    for part in (*CFLAGS, "|", *LDFLAGS):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _build_hash(src):
    """The build's key: the sources' hash, the compiler, torch and the Python ABI."""
    digest = hashlib.sha256(_source_hash(src).encode())
    for part in (str(compiler()), os.environ.get("CXX", ""), torch.__version__,
                 sys.implementation.cache_tag, sys.platform):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def build_directory():
    """Where the extension is (or will be) built."""
    env = os.environ.get(BUILD_DIR_ENV)
    if env:
        return Path(env).expanduser()
    src = source_dir()
    key = _build_hash(src) if src is not None else "nosources"
    return cache_root() / f"cpp-{torch.__version__}-{key}"


def cache_root():
    """The per-user folder holding the builds (one subfolder per torch version and hash)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]).expanduser() / "astrai_kernels"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "astrai_kernels"
    return Path.home() / ".cache" / "astrai_kernels"


def load_extension(verbose=False):
    """The compiled extension module, building it on first use (once per process, locked).

    A complete build of these sources (its marker matching the library) is imported as is,
    without ninja and without the lock: a read-only directory (a shared cache, a container
    image) serves that way, and checkouts at different paths sharing the cache do not rebuild
    each other's build. Raises ``RuntimeError`` when the toolchain is missing, when a directory
    that cannot be written holds no complete build, or when the build fails; for a failed build
    the message carries the compiler's full output.
    """
    global _EXTENSION, _BUILD_ERROR
    if _EXTENSION is not None:
        return _EXTENSION
    with _LOCK:
        if _EXTENSION is not None:
            return _EXTENSION
        if _BUILD_ERROR is not None:
            raise type(_BUILD_ERROR)(str(_BUILD_ERROR))
        src = source_dir()
        if src is None:
            raise RuntimeError(f"the cpp backend cannot be built: {_toolchain_reason()}")
        prebuilt, refusal = _prebuilt_library(src)
        if prebuilt is not None:
            try:
                _EXTENSION = import_library(*prebuilt)
                return _EXTENSION
            except ImportError as exc:
                refusal = f"loading it failed ({exc})"
        if refusal is not None:
            _say_prebuilt_refused(refusal)
        build_dir = build_directory()
        name = _extension_name(src)
        failure = (f"it holds no complete build of these sources ({name}{LIB_SUFFIX} with "
                   f"its {name}{COMPLETE_SUFFIX} marker)")
        library = complete_library(build_dir, name)
        if library is not None:
            try:
                _EXTENSION = import_library(name, library)
                return _EXTENSION
            except ImportError as exc:
                failure = f"loading its complete build {library} failed ({exc})"
        read_only = None if _writable(build_dir) else "is read-only"
        reason = _toolchain_reason()
        if read_only is None and reason is None:
            try:
                build_dir.mkdir(parents=True, exist_ok=True)
                lock = process_lock(build_dir)
                lock.__enter__()
            except PermissionError as exc:  # a mount or ACL the permission bits do not show
                read_only = f"cannot be written ({exc})"
            except OSError as exc:
                if exc.errno != errno.EROFS:
                    raise RuntimeError(f"the cpp backend cannot be used: preparing its build "
                                       f"directory {build_dir} failed ({exc})") from exc
                read_only = "is on a read-only file system"
            else:
                try:
                    _EXTENSION = _build(src, build_dir, name, verbose)
                finally:
                    lock.__exit__(None, None, None)
                return _EXTENSION
        if read_only is None:  # writable but no toolchain: not kept, the toolchain may appear
            raise RuntimeError(f"the cpp backend cannot be built: {reason}")
        if reason is not None:
            failure += f", and it cannot be built anywhere: {reason}"
        _BUILD_ERROR = RuntimeError(
            f"the cpp backend cannot be used: build directory {build_dir} {read_only} and "
            f"{failure}; set {BUILD_DIR_ENV} to a writable directory to build it there")
        raise type(_BUILD_ERROR)(str(_BUILD_ERROR))


def extension_if_built():
    """The extension when it is loaded, or imported now from a complete build of these sources
    (looked for once per process); None when only a build would give it. Never builds: the
    gradient cache (kernels/memory.py) asks on its first allocation, whatever the backend."""
    global _EXTENSION, _LOOKED_FOR_BUILD
    if _EXTENSION is not None or _LOOKED_FOR_BUILD:
        return _EXTENSION
    with _LOCK:
        if _EXTENSION is None and not _LOOKED_FOR_BUILD:
            _LOOKED_FOR_BUILD = True
            src = source_dir()
            found = None if src is None else _prebuilt_library(src)[0]
            if found is None and src is not None:
                library = complete_library(build_directory(), _extension_name(src))
                found = None if library is None else (_extension_name(src), library)
            if found is not None:
                try:
                    _EXTENSION = import_library(*found)
                except ImportError:
                    pass
    return _EXTENSION


def cached_library():
    """The library loading the extension would import without a build: the wheel's prebuilt one
    when it matches, else a complete build of these sources in ``build_directory()``; None when
    it would have to build it first."""
    src = source_dir()
    if src is None:
        return None
    prebuilt = _prebuilt_library(src)[0]
    if prebuilt is not None:
        return prebuilt[1]
    return complete_library(build_directory(), _extension_name(src))


def prebuilt_dir():
    """Where a wheel built with ``ASTRAI_KERNELS_PREBUILD=1`` carries the library and its
    manifest: ``astrai_kernels/prebuilt`` (absent from a checkout and from other wheels)."""
    return Path(__file__).resolve().parents[2] / "prebuilt"


def _prebuilt_key(src):
    """What a prebuilt library must have been built for to serve this process."""
    return {
        "torch": torch.__version__,
        "sources": _source_hash(src),
        # the instruction-set architecture of its code; within it the kernels pick AVX-512,
        # AVX2 or generic code at run time from the CPU's features
        "isa": platform.machine(),
        "python": sys.implementation.cache_tag,
        "platform": sys.platform,
    }


_PREBUILT_MISMATCH = {
    "torch": "it was built for torch {built}, this process runs torch {here}",
    "sources": "it was built from other C++ sources or flags (hash {built:.12}, these {here:.12})",
    "isa": "it was built for {built}, this machine is {here}",
    "python": "it was built for {built}, this interpreter is {here}",
    "platform": "it was built for {built}, this platform is {here}",
}


def _prebuilt_library(src):
    """``((module name, library), None)`` when the package carries a prebuilt library whose
    manifest matches this process (and whose bytes match the manifest's SHA-256);
    ``(None, why not)`` when it carries one that does not; ``(None, None)`` when it carries
    none."""
    folder = prebuilt_dir()
    try:
        manifest = json.loads((folder / PREBUILT_MANIFEST).read_text())
        module, library, recorded = manifest["module"], manifest["library"], manifest["sha256"]
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"its manifest {folder / PREBUILT_MANIFEST} cannot be read ({exc!r})"
    for key, here in _prebuilt_key(src).items():
        if manifest.get(key) != here:
            return None, _PREBUILT_MISMATCH[key].format(built=str(manifest.get(key)), here=here)
    library = folder / library
    try:
        actual = hashlib.sha256(library.read_bytes()).hexdigest()
    except OSError as exc:
        return None, f"its library cannot be read ({exc})"
    if actual != recorded:
        return None, f"{library} does not match the SHA-256 its manifest records"
    return (module, library), None


def _say_prebuilt_refused(reason):
    global _PREBUILT_REFUSAL_SAID
    if not _PREBUILT_REFUSAL_SAID:
        _PREBUILT_REFUSAL_SAID = True
        say(f"not loading the prebuilt C++ kernels in {prebuilt_dir()}: {reason}; "
             f"using the per-user build")


def write_prebuilt(folder):
    """Put the extension for the installed torch, built now or found complete in the per-user
    cache, into ``folder`` with the manifest ``_prebuilt_library`` checks; returns the copied
    library. setup.py calls it for a wheel built with ``ASTRAI_KERNELS_PREBUILD=1``."""
    src = source_dir()
    if src is None:
        raise RuntimeError(f"the cpp backend cannot be built: {_toolchain_reason()}")
    folder = Path(folder)
    if folder.resolve() == prebuilt_dir():  # an earlier build's copy: never load it as the build
        shutil.rmtree(folder, ignore_errors=True)
    built = Path(load_extension().__file__)
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / built.name
    shutil.copyfile(built, library)
    manifest = {"module": built.stem, "library": built.name,
                "sha256": hashlib.sha256(library.read_bytes()).hexdigest(), **_prebuilt_key(src)}
    (folder / PREBUILT_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return library


def _extension_name(src):
    return f"astrai_kernels_cpp_{_build_hash(src)[:12]}"


def _build(src, build_dir, name, verbose):
    """Build (or find up to date) and import the extension; the caller holds the lock."""
    global _BUILD_ERROR
    from torch.utils.cpp_extension import load

    library = complete_library(build_dir, name)  # another process may have just built it
    if library is not None:
        return import_library(name, library)
    sources = [s for s in SOURCES if s.endswith(".cpp")]
    say(f"compiling the cpp backend's C++ kernels once (a few minutes on a small machine; "
         f"later runs load the cached library) in {build_dir}; "
         f"set ASTRAI_KERNELS_BACKEND=torch to skip it and use the torch backend")
    started = time.perf_counter()
    outputs = [(f"{Path(s).stem}.o", f"compiled {s}") for s in sources]
    outputs.append((f"{name}{LIB_SUFFIX}", f"linked {name}{LIB_SUFFIX}"))
    try:
        with BuildProgress(build_dir, outputs, started):
            module = load(
                name=name,
                sources=[str(src / s) for s in sources],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                extra_include_paths=[str(src)],
                build_directory=str(build_dir),
                verbose=verbose,
            )
    except Exception as exc:  # the compiler's output is in the message
        output = failure_output(exc)
        cause = first_error_line(output)
        say(f"compiling the C++ kernels failed after {time.perf_counter() - started:.1f} s"
             + (f": {cause}" if cause else ""))
        _BUILD_ERROR = BuildFailed(f"building the cpp backend extension in {build_dir} failed "
                                   f"({type(exc).__name__}):\n{output}")
        raise type(_BUILD_ERROR)(str(_BUILD_ERROR)) from exc
    mark_complete(Path(module.__file__))
    say(f"built the C++ kernels in {time.perf_counter() - started:.1f} s: {module.__file__}")
    return module


def _writable(build_dir):
    """Whether ``build_dir`` (or, while it does not exist, its nearest existing parent) can be
    written by this process, as far as its permissions tell."""
    path = build_dir
    while not path.exists() and path.parent != path:
        path = path.parent
    return os.access(path, os.W_OK)


def _warn_once(reason):
    global _WARNED
    if not _WARNED:
        _WARNED = True
        warnings.warn(f"astrai_kernels: the cpp backend is unavailable ({reason}); "
                      f"CPU tensors fall back to the 'torch' backend.", RuntimeWarning,
                      stacklevel=3)


def unavailable_reason(device):
    """None when the cpp backend can serve tensors on ``device``, else a sentence saying why."""
    device = torch.device(device)
    if device.type != "cpu":
        return f"the cpp backend serves CPU tensors only (got a {device.type} device)"
    if _EXTENSION is not None:
        return None
    try:
        load_extension()
        return None
    except BuildFailed as exc:
        first = str(exc).splitlines()[0]
        reason = (f"{first}; call astrai_kernels.kernels.cpp.backend.load_extension() to see "
                  f"the compiler output")
    except RuntimeError as exc:
        reason = str(exc).removeprefix("the cpp backend cannot be built: ")
    _warn_once(reason)
    return reason


def isa():
    """The instruction set the kernels run with (``generic``, ``avx2`` or ``avx512``)."""
    return load_extension().isa()


def set_isa(name):
    """Run the kernels with instruction set ``name`` (capped at the CPU's); returns the old one."""
    return load_extension().set_isa(name)


def _rows_f32(tensor):
    """A contiguous float32 tensor of the same elements (a no-op for the usual inputs)."""
    if tensor is None:
        return None
    return tensor.reshape(-1).to(torch.float32).contiguous()


def _target(target):
    target = target.reshape(-1)
    if target.dtype not in (torch.int64, torch.int32):
        target = target.long()
    return target.contiguous()


# Each primitive hands its params object (kernels/primitives.py's dataclass) to the extension as
# is: bindings.cpp reads its fields by name into one struct per params class.

def logprobs_forward(logits, target, params):
    return load_extension().logprobs_forward(logits, _target(target), params)


def logprobs_backward(logits, target, lse, entropy, grad_logp, grad_entropy, params, grad):
    with_entropy = grad_entropy is not None and grad_entropy.numel() > 0
    load_extension().logprobs_backward(
        logits, _target(target), _rows_f32(lse), _rows_f32(entropy) if with_entropy else None,
        _rows_f32(grad_logp), _rows_f32(grad_entropy) if with_entropy else None, params, grad)


def cross_entropy_forward(logits, target, grad_scale, params, grad):
    return load_extension().cross_entropy_forward(
        logits, _target(target), _rows_f32(grad_scale) if grad is not None else None, params,
        grad)


def grpo_forward(logits, target, advantages, old_logprobs, ref_logprobs, token_weight, params,
                 grad):
    return load_extension().grpo_forward(
        logits, _target(target), _rows_f32(advantages), _rows_f32(old_logprobs),
        _rows_f32(ref_logprobs), _rows_f32(token_weight), params, grad)


def distill_forward(student, teacher, target, grad_scale, params, grad):
    return load_extension().distill_forward(
        student, teacher, _target(target), _rows_f32(grad_scale) if grad is not None else None,
        params, grad)


def distill_backward(student, teacher, target, student_lse, teacher_lse, student_kl, hard_lse,
                     grad_loss, params, grad):
    load_extension().distill_backward(
        student, teacher, _target(target), _rows_f32(student_lse), _rows_f32(teacher_lse),
        _rows_f32(student_kl), _rows_f32(hard_lse) if params.hard_weight else None,
        _rows_f32(grad_loss), params, grad)


def vocab_shard_backward(logits, target, lse, alpha, beta, gamma, delta, params, grad):
    load_extension().vocab_shard_backward(
        logits, _target(target), _rows_f32(lse), _rows_f32(alpha), _rows_f32(beta),
        _rows_f32(gamma), _rows_f32(delta), params, grad)


def sampled_logprobs_forward(logits, target, params):
    return load_extension().sampled_logprobs_forward(logits, _target(target), params)


def sampled_logprobs_backward(logits, target, lse_kept, threshold, coef, params, grad):
    load_extension().sampled_logprobs_backward(
        logits, _target(target), _rows_f32(lse_kept), _rows_f32(threshold), _rows_f32(coef),
        params, grad)


def topk_distill_forward(logits, support_ids, teacher, live, counted, grad_scale, params, grad):
    return load_extension().topk_distill_forward(
        logits, support_ids.long().contiguous(), teacher.float().contiguous(),
        live.contiguous(), counted.contiguous(),
        _rows_f32(grad_scale) if grad is not None else None, params, grad)


def row_kth_largest(logits, k, ids=None):
    """Per row of ``logits [..., V]`` (float32, bfloat16 or float16 on the CPU, any strides) the
    ``k``-th largest element: ``(value, index)``, float32 and int64 of shape ``[...]``; with
    ``ids [..., m]`` (integers in ``[0, V)``) also ``in_top_k``, bool ``[..., m]``: whether each
    id is among its row's ``k`` largest.

    Not a primitive of ``kernels/primitives.py``: verl's top-K overlap
    (``integrations/verl/distillation.py``) reads the student's top-``k`` membership from it.
    The order is the one ``torch.topk`` ranks by (larger first, NaN above every number), its
    ties (which ``torch.topk`` leaves unspecified) broken by the lower index first: element
    ``j`` is among the row's ``k`` largest iff ``(x_j, -j) >= (value, -index)``. A row with
    ``k`` or more NaNs gives a NaN value. One streaming read of each row
    (``csrc/row_topk.cpp``). ``k`` outside ``[1, V]`` and ids out of range raise
    ``ValueError``.
    """
    if logits.dim() == 0:
        raise ValueError("logits must have a last dimension (the vocabulary), got a 0-d tensor")
    vocab, lead = logits.shape[-1], logits.shape[:-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
        raise ValueError(f"k must be an int between 1 and the logits' last dimension {vocab}, "
                         f"got k={k!r}")
    if ids is not None and (ids.dim() == 0 or ids.shape[:-1] != lead):
        raise ValueError(f"ids must have shape [..., m] with the logits' leading shape "
                         f"{tuple(lead)}, got {tuple(ids.shape)}")
    rows = logits if logits.dim() in (2, 3) else logits.reshape(-1, vocab)
    value, index, in_top_k = load_extension().row_kth_largest(
        rows if rows.dim() == 3 else rows[None], k,
        None if ids is None else ids.reshape(-1, ids.shape[-1]).long().contiguous())
    value, index = value.reshape(lead), index.reshape(lead)
    return (value, index) if ids is None else (value, index, in_top_k.reshape(ids.shape))
