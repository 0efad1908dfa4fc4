// Runs gpu_impl's fused CUDA kernel on the CPU, so that its logic (indexing,
// masks from positions, skipped tiles, the online softmax, barriers) is checked
// against the plain step on a machine without a GPU (tests/test_gpu.py).
//
// Each block's threads are std::threads that meet at a std::barrier for
// __syncthreads; blocks run one after another, so the kernel's __shared__
// arrays (function statics here) belong to the running block. A barrier that
// some thread of a block never reaches hangs the emulation, as it would hang
// the GPU: the test has a timeout.
//
// With -DKV_HALF=1 the kernel reads float16 K and V as their bits; the
// compiler's _Float16 converts them here, where the GPU uses one PTX instruction.
//
//   g++ -std=c++20 -O1 -shared -fPIC -pthread -Wno-unknown-pragmas \
//       -DHEAD_DIM=16 -DTQ=64 -DTK=32 -DKERNEL='"gpu_impl/kernels/attend_block_v1.cu"' \
//       -o emulated.so tests/gpu/emulate_cuda.cpp

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

struct Index3 { unsigned x = 0, y = 0, z = 0; };
thread_local Index3 threadIdx, blockIdx;
static std::barrier<>* block_barrier = nullptr;

#define __global__
#define __device__
#define __shared__ static
#define __launch_bounds__(n)
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, sizeof f); return f; }
inline float half_to_float(unsigned short h) { _Float16 x; std::memcpy(&x, &h, sizeof x); return float(x); }
#define HALF_TO_FLOAT half_to_float
using std::max;
using std::min;

#include KERNEL

// attend_block_v1 on a (gx, gy, gz) grid of TQ threads per block.
extern "C" void launch_attend_block_v1(int gx, int gy, int gz,
                                       const float* q, const kv_t* k, const kv_t* v,
                                       const long long* q_pos, const long long* k_pos,
                                       float* o, float* m, float* l, int c, int ck, int G, int causal)
{
    std::barrier<> barrier(TQ);
    block_barrier = &barrier;
    for (int z = 0; z < gz; ++z)
        for (int y = 0; y < gy; ++y)
            for (int x = 0; x < gx; ++x) {
                std::vector<std::thread> threads;
                for (int t = 0; t < TQ; ++t)
                    threads.emplace_back([=] {
                        threadIdx = {unsigned(t), 0, 0};
                        blockIdx = {unsigned(x), unsigned(y), unsigned(z)};
                        attend_block_v1(q, k, v, q_pos, k_pos, o, m, l, c, ck, G, causal);
                    });
                for (auto& th : threads)
                    th.join();
            }
}
