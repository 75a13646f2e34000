// cudaStream_t without the CUDA headers, so that launcher declarations can be included by code
// built without CUDA (the C++ tests, the CPU-only extension). Same typedef as driver_types.h.
#pragma once

typedef struct CUstream_st* cudaStream_t;
