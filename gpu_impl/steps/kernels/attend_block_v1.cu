// attend_block_v1: one query shard against one key/value block, fused.
//
// The same contract as reference/step.py's attend_block (the plain step): the
// running softmax state (o, m, l) of every query row is read, updated with the
// keys of this block, and written back, so that calls over the ring's rounds
// accumulate. Paper, Algorithm 1 (AccumulateAttentionFragment) and section
// 2.2.1 (skipping tiles that no query can see).
//
// Check it, and run it:
//   nvcc -arch=sm_90 -cubin -DHEAD_DIM=64 gpu_impl/steps/kernels/attend_block_v1.cu
//   .venv/bin/python -m pytest tests/gpu/test_gpu.py -q -k emulated     # on the CPU, against the readable step
//   gpu_impl.ring_attention(q, k, v, comm=comm, step="fused")
//
// What version 1 changes from the readable step on CuPy (reference/step.py's
// step with CuPy arrays: a few array operations per tile, each a kernel that
// writes the tile's scores to GPU memory and reads them back): the whole block
// in one launch, the simplest fused kernel. One thread per query row (its q
// and o in registers), a tile of TK keys and values and the tile's scores in
// shared memory, float32 arithmetic; K and V are read as they travel, float32
// or (with -DKV_HALF=1) float16, so float16 blocks are never cast in a copy;
// tiles no query of the CTA can see skipped from positions on the GPU.
//
// What it bought: not measured yet, no GPU has run it. Expected on an H200
// about 10-25 TFLOP/s of useful work at D = 64 and 6-15 at D = 128, estimated
// from its SASS (bench/gpu_kernel.py): its products are a D-long chain of
// dependent FP32 FMAs per key and thread, and its shared-memory scores are
// bank-conflicted. Version 2 (attend_block_v2.cu) moves the products to the
// tensor cores. Validated against the plain step before it is timed (like
// llm.c's dev/cuda kernels).
//
// Compute layout (C-contiguous), BH = B * Hkv, G = Hq / Hkv:
//   q, o  (BH, c, G, HEAD_DIM)   float32; q pre-scaled by the softmax scale
//   m, l  (BH, c, G)             float32 running row max and row sum
//   k, v  (BH, ck, HEAD_DIM)     KV_T: float32, or float16 with KV_HALF
//   q_pos (c,), k_pos (ck,)      global positions (int64): masks come from them
// Grid (ceil(c / TQ), G, BH), TQ threads: block (x, g, bh) holds queries
// x*TQ .. x*TQ+TQ-1 of query head g of group bh, the tile's rows.
//
// Per key tile (FlashAttention's online softmax, one row per thread):
//   S = q K^T (masked: -inf where k_pos > q_pos)
//   m_new = max(m, rowmax(S));  P = exp(S - m_new)
//   l = l * exp(m - m_new) + rowsum(P);  o = o * exp(m - m_new) + P V
//
// NaN and inf follow reference/step.py's rule, as its readable step computes
// it: a masked pair contributes nothing whatever its values; a visible pair
// contributes P V even where P underflows to 0 (0 x NaN = NaN, 0 x inf = NaN);
// a row whose scores so far are all -inf subtracts 0, not -inf, so that its
// P is exp(-inf) = 0 rather than NaN. A row with no visible key keeps m = -inf,
// l = 0, o = 0 (the caller's finish gives out 0, lse -inf).
//
// Flushing. CuPy compiles kernels with -ftz=true: float32 values below 2^-126
// are read and written as 0. So a weight P = exp(S - m) with S - m below about
// -87.3 is 0 here where NumPy's readable step keeps a subnormal: where V holds
// inf at such a key, out is NaN (0 x inf) here and inf there. Every other case
// of the rule is the same. (The CPU emulation, tests/support/gpu/emulate_cuda.cpp,
// flushes likewise.)
//
// Compile-time sizes (nvcc -D or NVRTC options): HEAD_DIM, TQ, TK, KV_HALF.

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef TQ
#define TQ 64
#endif
#ifndef TK
#define TK 32
#endif

#ifndef KV_HALF
#define KV_HALF 0
#endif

#define NEG_INF __int_as_float(0xff800000)

#if KV_HALF
// float16 as its bits, converted by one PTX instruction: no header needed, so
// nvcc and NVRTC compile it alike (the CPU emulation brings HALF_TO_FLOAT).
typedef unsigned short kv_t;
#ifndef HALF_TO_FLOAT
__device__ inline float kv_float(unsigned short h)
{
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
#else
inline float kv_float(unsigned short h) { return HALF_TO_FLOAT(h); }
#endif
#else
typedef float kv_t;
__device__ inline float kv_float(float x) { return x; }
#endif

extern "C" __global__ void __launch_bounds__(TQ)
attend_block_v1(const float* __restrict__ q, const kv_t* __restrict__ k,
                const kv_t* __restrict__ v,
                const long long* __restrict__ q_pos, const long long* __restrict__ k_pos,
                float* __restrict__ o, float* __restrict__ m, float* __restrict__ l,
                int c, int ck, int G, int causal)
{
    __shared__ float Ks[TK][HEAD_DIM];
    __shared__ float Vs[TK][HEAD_DIM];
    __shared__ float S[TK][TQ];
    __shared__ long long kp[TK];
    __shared__ bool v_finite[TK];                  // row j of the V tile holds no NaN or inf
    __shared__ long long q_max_tile;

    const int tid = threadIdx.x;
    const int qi = blockIdx.x * TQ + tid;          // this thread's query (local index)
    const int g = blockIdx.y;
    const long long bh = blockIdx.z;
    const bool active = qi < c;                    // the last tile may be short

    // This thread's row: its query, pre-scaled, and its running state.
    const long long row = (bh * c + (active ? qi : 0)) * G + g;
    float q_r[HEAD_DIM], o_r[HEAD_DIM];
    float m_r = NEG_INF, l_r = 0.0f;
    long long my_pos = -1;
    if (active) {
        #pragma unroll
        for (int d = 0; d < HEAD_DIM; ++d) {
            q_r[d] = q[row * HEAD_DIM + d];
            o_r[d] = o[row * HEAD_DIM + d];
        }
        m_r = m[row];
        l_r = l[row];
        my_pos = q_pos[qi];
    }

    // The latest query of the tile decides which key tiles it can skip.
    if (tid == 0) {
        long long hi = -1;
        for (int i = blockIdx.x * TQ; i < min(c, (int)(blockIdx.x + 1) * TQ); ++i)
            hi = max(hi, q_pos[i]);
        q_max_tile = hi;
    }

    const kv_t* k_bh = k + bh * (long long)ck * HEAD_DIM;
    const kv_t* v_bh = v + bh * (long long)ck * HEAD_DIM;

    for (int k0 = 0; k0 < ck; k0 += TK) {
        const int nk = min(TK, ck - k0);
        __syncthreads();                           // hazard: the previous tile is still being read
        for (int j = tid; j < nk; j += TQ)
            kp[j] = k_pos[k0 + j];
        __syncthreads();

        // Skip a tile that no query of this tile can see: max(q_pos) < min(k_pos)
        // (the pair rule pos_k <= pos_q at the extreme pair; reference/tiles.py).
        // Every thread reaches the same decision, so the __syncthreads stay uniform.
        if (causal) {
            long long k_min = kp[0];
            for (int j = 1; j < nk; ++j)
                k_min = min(k_min, kp[j]);
            if (q_max_tile < k_min)
                continue;
        }

        for (int idx = tid; idx < nk * HEAD_DIM; idx += TQ) {
            const int j = idx / HEAD_DIM, d = idx % HEAD_DIM;
            Ks[j][d] = kv_float(k_bh[(long long)(k0 + j) * HEAD_DIM + d]);
            Vs[j][d] = kv_float(v_bh[(long long)(k0 + j) * HEAD_DIM + d]);
        }
        __syncthreads();
        for (int j = tid; j < nk; j += TQ) {
            bool finite = true;
            for (int d = 0; d < HEAD_DIM; ++d)
                finite = finite && fabsf(Vs[j][d]) <= 3.402823466e38f;   // false for NaN and inf
            v_finite[j] = finite;
        }
        __syncthreads();
        if (!active)
            continue;

        // S = q K^T for this row, masked; kept in shared memory, column tid
        // (consecutive threads, consecutive banks)
        float tile_max = NEG_INF;
        for (int j = 0; j < nk; ++j) {
            float dot = NEG_INF;
            if (!causal || kp[j] <= my_pos) {
                dot = 0.0f;
                #pragma unroll
                for (int d = 0; d < HEAD_DIM; ++d)
                    dot += q_r[d] * Ks[j][d];
            }
            S[j][tid] = dot;
            tile_max = fmaxf(tile_max, dot);
        }

        const float m_new = fmaxf(m_r, tile_max);
        // Hazard: a row whose scores so far are all -inf has m_new = -inf, and
        // exp(-inf - -inf) is NaN: subtract 0 instead, so that P = exp(-inf) = 0.
        const float m_safe = m_new == NEG_INF ? 0.0f : m_new;
        const float alpha = expf(m_r - m_safe);    // m_r = -inf gives 0: nothing to rescale
        l_r *= alpha;
        #pragma unroll
        for (int d = 0; d < HEAD_DIM; ++d)
            o_r[d] *= alpha;
        for (int j = 0; j < nk; ++j) {
            if (causal && kp[j] > my_pos)
                continue;                          // masked: nothing, whatever V holds
            const float p = expf(S[j][tid] - m_safe);
            // P = 0 adds nothing to a finite V row; to a NaN or inf it adds NaN (0 x inf)
            if (p == 0.0f && v_finite[j])
                continue;
            l_r += p;
            #pragma unroll
            for (int d = 0; d < HEAD_DIM; ++d)
                o_r[d] += p * Vs[j][d];
        }
        m_r = m_new;
    }

    if (active) {
        #pragma unroll
        for (int d = 0; d < HEAD_DIM; ++d)
            o[row * HEAD_DIM + d] = o_r[d];
        m[row] = m_r;
        l[row] = l_r;
    }
}
