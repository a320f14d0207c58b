"""The C++ sources go into the wheel: ``csrc/`` (their one copy, at the top of the repository)
is copied into the built package as ``astrai_kernels/csrc/``, where the cpp backend finds them
in an installed package (an editable install reads the checkout's ``csrc/`` instead).

With ``ASTRAI_KERNELS_PREBUILD=1`` the wheel also carries the compiled library for the torch of
the build environment (``pip wheel . --no-build-isolation``), in ``astrai_kernels/prebuilt/``
with its manifest: it is the per-user cache's build when that is complete, else built now. Such
a wheel is tagged for this Python and platform; where it is installed beside the same torch the
first call loads the library without a compiler, elsewhere the package builds as any other.

Everything else is declared in pyproject.toml; MANIFEST.in puts ``csrc/`` in the sdist."""

import importlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

CSRC = Path(__file__).resolve().parent / "csrc"
PREBUILD_ENV = "ASTRAI_KERNELS_PREBUILD"


def prebuild_requested():
    value = os.environ.get(PREBUILD_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{PREBUILD_ENV} must be 1 (put the compiled library in the wheel) or "
                         f"0 / unset, got {value!r}")
    return value == "1"


def load_backend(build_lib):
    """The built copy of the cpp backend's loader (astrai_kernels/kernels/cpp/backend.py and its
    build.py, which import torch and nothing else of the package) as a package of their own, so
    the package itself need not import here."""
    folder = Path(build_lib) / "astrai_kernels" / "kernels" / "cpp"
    package = "astrai_kernels_prebuild"
    try:
        spec = importlib.util.spec_from_file_location(
            package, folder / "__init__.py", submodule_search_locations=[str(folder)])
        sys.modules[package] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[package])
        module = importlib.import_module(f"{package}.backend")
    except ModuleNotFoundError as exc:
        raise RuntimeError(
            f"{PREBUILD_ENV}=1 puts the library compiled for the build environment's torch into "
            f"the wheel, and that environment has no {exc.name}: build with "
            f"`pip wheel . --no-build-isolation` where torch is installed") from exc
    return module


class build_py_with_csrc(build_py):
    def _csrc_files(self):
        sources = sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")])
        if not sources:
            raise FileNotFoundError(f"no C++ sources in {CSRC}: the cpp backend needs them")
        target = Path(self.build_lib) / "astrai_kernels" / "csrc"
        return [(source, target / source.name) for source in sources]

    def _prebuilt_folder(self):
        return Path(self.build_lib) / "astrai_kernels" / "prebuilt"

    def run(self):
        super().run()
        if self.editable_mode:
            return
        for source, target in self._csrc_files():
            self.mkpath(str(target.parent))
            self.copy_file(str(source), str(target))
        # an earlier build's library in build/lib must not reach a wheel built without it
        shutil.rmtree(self._prebuilt_folder(), ignore_errors=True)
        if prebuild_requested():
            library = load_backend(self.build_lib).write_prebuilt(self._prebuilt_folder())
            self.announce(f"prebuilt cpp backend library: {library}", level=2)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if self.editable_mode:
            return outputs
        outputs += [str(target) for _, target in self._csrc_files()]
        if prebuild_requested() and self._prebuilt_folder().is_dir():
            outputs += [str(path) for path in sorted(self._prebuilt_folder().iterdir())]
        return outputs


class DistributionWithLibrary(Distribution):
    """A wheel carrying the compiled library is one for this Python and platform."""

    def has_ext_modules(self):
        return prebuild_requested()


setup(cmdclass={"build_py": build_py_with_csrc}, distclass=DistributionWithLibrary)
