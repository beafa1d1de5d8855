"""llama.cpp's own quantizer through its C API (`llama_model_quantize` with its default
parameters but the file type: what `llama-quantize` does).

Usage: quantize.py SRC.gguf DST.gguf LLAMA_FTYPE_NAME. Exits with llama.cpp's return code.
"""

import ctypes
import sys

import llama_cpp as L


def main():
    src, dst, ftype = sys.argv[1], sys.argv[2], sys.argv[3]
    params = L.llama_model_quantize_default_params()
    params.ftype = getattr(L, ftype)
    sys.exit(L.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))


if __name__ == "__main__":
    main()
