#!/usr/bin/env bash
# Build llama-cpp-python 0.3.36 with ggml's CUDA backend for sm_90 (H200) only, as a wheel in .whl/,
# so gpu_check's `llama-cpp` section can run llama.cpp on the GPU machine (which cannot download).
#
#   nice -n 19 scripts/gpu_check/build_llama_cpp.sh            # work in /tmp/llama-cpp-build, wheel -> .whl/
#   JOBS=2 WORK=/tmp/x OUT=/tmp/wheels scripts/gpu_check/build_llama_cpp.sh
#
# Why each choice (docs/gpu-results.md, "llama.cpp on the GPU", has the measured time and size):
# - only sm_90, GGML_NATIVE off, no FA all-quants, no llava/mtmd, no tests/examples/tools, no NCCL:
#   every ggml-cuda .cu file is compiled once per architecture, so one architecture and the default
#   flash-attention instances keep both build time and the wheel small (the wheel travels in 64 MiB).
# - cuBLAS: this machine's CUDA 13.0 has nvcc and cudart but no cuBLAS, so its headers and library
#   come from the nvidia-cublas 13.0 wheel, used only to compile and link. Nothing of cuBLAS is put
#   in the wheel: the GPU image has libcublas.so.13 (its nvidia-cublas package, beside torch) and
#   gpu_check's section puts that folder on LD_LIBRARY_PATH when it starts llama.cpp.
# - the wheel is tagged py3-none-linux_x86_64 (llama-cpp-python loads its libraries with ctypes), so
#   the build's python (3.11 here) need not match the GPU image's 3.12.
# - symbols stripped (scikit-build-core's install.strip).
# Run it under `nice -n 19` with JOBS=2 at most on a shared machine; it prints the minutes it took.
set -euo pipefail

VERSION=0.3.36
CUBLAS_SPEC='nvidia-cublas>=13.0,<13.1'
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${WORK:-/tmp/llama-cpp-build}
OUT=${OUT:-$ROOT/.whl}
JOBS=${JOBS:-2}
PYTHON=${PYTHON:-python3}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

start=$(date +%s)
mkdir -p "$WORK" "$OUT"
cd "$WORK"

if [ ! -d "llama_cpp_python-$VERSION" ]; then
  "$PYTHON" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d sdist
  tar xzf "sdist/llama_cpp_python-$VERSION.tar.gz"
fi
if [ ! -f cublas/nvidia/cu13/lib/libcublas.so.13 ]; then
  "$PYTHON" -m pip download -q --no-deps --only-binary :all: "$CUBLAS_SPEC" -d cublas-wheel
  mkdir -p cublas
  (cd cublas && "$PYTHON" -m zipfile -e ../cublas-wheel/nvidia_cublas-*.whl .)
fi
CUBLAS=$WORK/cublas/nvidia/cu13
# FindCUDAToolkit looks for libcublas.so (unversioned) beside cudart: give it the wheel's library by path.
ln -sf libcublas.so.13 "$CUBLAS/lib/libcublas.so"
ln -sf libcublasLt.so.13 "$CUBLAS/lib/libcublasLt.so"

# ggml-cuda links the driver API (libcuda.so.1) for its VMM memory pool; this machine has no driver
# and CUDA 13.0 here has no stubs/ folder, so link against a stub with the eleven cu* functions ggml
# calls and the real soname: at run time the GPU machine's driver provides them.
mkdir -p cudastub
names="cuDeviceGet cuDeviceGetAttribute cuGetErrorString cuMemAddressFree cuMemAddressReserve cuMemCreate
 cuMemGetAllocationGranularity cuMemMap cuMemRelease cuMemSetAccess cuMemUnmap"
for n in $names; do echo "int $n(void) { return 999; }"; done > cudastub/stub.c
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o cudastub/libcuda.so cudastub/stub.c

export CUDACXX=$CUDA_HOME/bin/nvcc
export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS
export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=off \
 -DGGML_CUDA_FA_ALL_QUANTS=off -DGGML_CUDA_NCCL=off -DLLAVA_BUILD=off \
 -DLLAMA_BUILD_TESTS=off -DLLAMA_BUILD_EXAMPLES=off -DLLAMA_BUILD_TOOLS=off -DLLAMA_BUILD_SERVER=off \
 -DCUDA_cublas_LIBRARY=$CUBLAS/lib/libcublas.so -DCUDA_cublasLt_LIBRARY=$CUBLAS/lib/libcublasLt.so \
 -DCUDA_cuda_driver_LIBRARY=$WORK/cudastub/libcuda.so \
 -DCMAKE_CUDA_FLAGS=-I$CUBLAS/include -DCMAKE_CXX_FLAGS=-I$CUBLAS/include"

rm -f "$OUT"/llama_cpp_python-*.whl
"$PYTHON" -m pip wheel -v --no-deps -w "$OUT" \
  -Cbuild-dir="$WORK/build" -Cinstall.strip=true -Ccmake.build-type=Release \
  "$WORK/llama_cpp_python-$VERSION" > "$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }

end=$(date +%s)
wheel=$(ls "$OUT"/llama_cpp_python-"$VERSION"-*.whl)
echo "built $wheel: $(du -m "$wheel" | cut -f1) MiB in $(( (end - start) / 60 )) min $(( (end - start) % 60 )) s"
echo "its libraries need at run time:"
"$PYTHON" -m zipfile -l "$wheel" | grep '\.so' || true
