"""Build shim: setup.cfg holds the metadata; this only names the cffi kernels to compile."""

from setuptools import setup

setup(
    cffi_modules=[
        "embstore/_kernels/build.py:ffibuilder",
        "embstore/_kernels/build.py:checksum_ffibuilder",
        "embstore/_kernels/build.py:policy_ffibuilder",
        "embstore/_kernels/build.py:bag_ffibuilder",
        "embstore/_kernels/build.py:optim_ffibuilder",
        "embstore/_kernels/build_libpmem.py:ffibuilder",
        "embstore/_kernels/build_libpmem.py:records_ffibuilder",
    ]
)
