"""The BLAS that this process's torch does its matrix products on, for the `blas` field of the Python benchmarks'
JSON lines (volt's own benchmarks write volt::blas_info()'s name there). pip's torch carries MKL; Debian's
python3-torch calls `libblas.so.3`, the alternative Debian points at OpenBLAS or at netlib's reference BLAS, found here
by the file the process has mapped under that name.
"""
import torch


def blas_name():
    if torch.backends.mkl.is_available():
        return "MKL"
    with open("/proc/self/maps") as maps:
        files = {line.split()[-1] for line in maps if "/" in line}
    blas = [f for f in files if f.rsplit("/", 1)[-1].startswith("libblas.so")]
    if not blas:
        return "none"
    variants = (("openblas-openmp", "OpenMP"), ("openblas-pthread", "pthreads"), ("openblas-serial", "serial"))
    for variant, name in variants:
        if any(variant in f for f in blas):
            return f"OpenBLAS ({name})"
    if any("openblas" in f for f in blas):
        return "OpenBLAS"
    if any(f.rsplit("/", 2)[-2] == "blas" for f in blas):
        return "reference"
    return "unknown"
