"""Builds the CPU kernels at install: every instruction-set variant this machine's compiler
targets (jaxinfer/kernels/cpu/build.py), into the package's kernels/cpu/lib/. The rest of the
package is declared in pyproject.toml. Without a compiler, or with a variant that fails to
build, the install still succeeds: those products take the graph path, and `jaxinfer info`
says why."""

import importlib.util
import sys
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build

ROOT = Path(__file__).parent


def _build_module():
    """kernels/cpu/build.py loaded from the source tree (the package is not importable yet)."""
    spec = importlib.util.spec_from_file_location(
        "_jaxinfer_build", ROOT / "jaxinfer/kernels/cpu/build.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class BuildKernels(Command):
    """`build_kernels`: the variants' libraries into kernels/cpu/lib (of the build tree, or of the
    source tree for an editable install)."""

    description = "build the CPU kernel variants"
    user_options = []

    def initialize_options(self):
        self.build_lib = None
        self.editable_mode = False

    def finalize_options(self):
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self):
        kernels = _build_module()
        try:
            import jax.ffi

            include = jax.ffi.include_dir()
        except Exception as e:  # noqa: BLE001 - any failure: the graph path, said once
            print(f"jaxinfer: CPU kernels not built (no XLA FFI headers: {e})")
            return
        folder = (
            kernels.LIBRARIES
            if self.editable_mode
            else Path(self.build_lib) / "jaxinfer/kernels/cpu/lib"
        )
        for variant in kernels.VARIANTS:
            if not kernels.buildable(variant):
                continue
            try:
                path = kernels.build(variant, include, folder)
                print(f"jaxinfer: built the {variant.name} CPU kernels ({path.name})")
            except kernels.BuildError as e:
                print(f"jaxinfer: the {variant.name} CPU kernels were not built: {e}")

    def get_outputs(self):
        return []

    def get_source_files(self):
        return []


class Build(build):
    sub_commands = [*build.sub_commands, ("build_kernels", None)]


setup(cmdclass={"build": Build, "build_kernels": BuildKernels})
