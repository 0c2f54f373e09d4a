#!/usr/bin/env bash
# Here, not on the GPU machine: packs llama.cpp's sources from the llama-cpp-python sdist into
# .snap/llama-src.tar.xz (about 6 MB: docs, models, tests, examples and the other GPU backends
# left out), small enough to travel with a device call. The sdist is downloaded when absent.
set -euo pipefail
SDIST_DIR=${SDIST_DIR:-/tmp/llsrc}
sdist=$(ls "$SDIST_DIR"/llama_cpp_python-*.tar.gz 2>/dev/null | head -1 || true)
if [ -z "$sdist" ]; then
  mkdir -p "$SDIST_DIR"
  python3 -m pip download --no-deps --no-binary :all: --dest "$SDIST_DIR" llama-cpp-python
  sdist=$(ls "$SDIST_DIR"/llama_cpp_python-*.tar.gz | head -1)
fi
work=$(mktemp -d)
tar -xzf "$sdist" -C "$work"
src=$(ls -d "$work"/llama_cpp_python-*/vendor/llama.cpp)
rm -rf "$src"/{docs,models,media,tests,benches,gguf-py,conversion,examples}
for b in virtgpu cann openvino webgpu et metal hexagon sycl vulkan opencl zdnn blas rpc musa hip; do
  rm -rf "$src/ggml/src/ggml-$b"
done
mkdir -p .snap
tar -cJf .snap/llama-src.tar.xz -C "$(dirname "$src")" llama.cpp
rm -rf "$work"
ls -la .snap/llama-src.tar.xz
