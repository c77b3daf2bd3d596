# The cffi extensions are declared here (pyproject.toml cannot name cffi_modules);
# everything else is in pyproject.toml.
from setuptools import setup

setup(
    cffi_modules=[
        "native/ffi_wire.py:ffibuilder",
        "native/ffi_dataplane.py:ffibuilder",
        "native/ffi_ingress.py:ffibuilder",
        "native/ffi_snapindex.py:ffibuilder",
    ],
)
