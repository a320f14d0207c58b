"""The C++ sources go into the wheel: ``csrc/`` (their one copy, at the top of the repository)
is copied into the built package as ``astrai_kernels/csrc/``, where the cpp backend finds them
in an installed package (an editable install reads the checkout's ``csrc/`` instead).
Everything else is declared in pyproject.toml; MANIFEST.in puts ``csrc/`` in the sdist."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CSRC = Path(__file__).resolve().parent / "csrc"


class build_py_with_csrc(build_py):
    def _csrc_files(self):
        sources = sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")])
        if not sources:
            raise FileNotFoundError(f"no C++ sources in {CSRC}: the cpp backend needs them")
        target = Path(self.build_lib) / "astrai_kernels" / "csrc"
        return [(source, target / source.name) for source in sources]

    def run(self):
        super().run()
        if self.editable_mode:
            return
        for source, target in self._csrc_files():
            self.mkpath(str(target.parent))
            self.copy_file(str(source), str(target))

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if self.editable_mode:
            return outputs
        return outputs + [str(target) for _, target in self._csrc_files()]


setup(cmdclass={"build_py": build_py_with_csrc})
