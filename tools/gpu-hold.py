#!/usr/bin/env python3
"""Holds MIB MiB of GPU 0's memory for SECONDS through the CUDA driver API
alone (no framework), and says `holding MIB MiB` once it does: a process
of known GPU memory for the telemetry checks.

    python3 tools/gpu-hold.py MIB SECONDS
"""
import ctypes, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
def ok(r, what):
    if r != 0:
        print(what, "failed", r, flush=True); sys.exit(1)
ok(cuda.cuInit(0), "cuInit")
dev = ctypes.c_int(); ok(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p(); ok(cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate")
n = int(sys.argv[1]) << 20
ptr = ctypes.c_uint64(); ok(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(n)), "cuMemAlloc")
ok(cuda.cuMemsetD8_v2(ptr, ctypes.c_ubyte(1), ctypes.c_size_t(n)), "cuMemset")
ok(cuda.cuCtxSynchronize(), "sync")
print("holding", sys.argv[1], "MiB", flush=True)
time.sleep(float(sys.argv[2]))
