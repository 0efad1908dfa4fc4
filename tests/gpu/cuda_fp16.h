// Stands in for CUDA's cuda_fp16.h when tests/gpu/emulate_cuda.cpp compiles the
// fused kernel for the CPU: float16 as the compiler's _Float16 (IEEE binary16).
#pragma once
typedef _Float16 __half;
inline float __half2float(__half x) { return static_cast<float>(x); }
