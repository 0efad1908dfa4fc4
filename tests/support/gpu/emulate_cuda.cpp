// Runs gpu_impl's fused CUDA kernels on the CPU, so that their logic (indexing,
// masks from positions, skipped tiles, the online softmax, barriers, and for
// version 2 the warp-level operations: fragment layouts of mma.sync and
// ldmatrix, shuffles, cp.async and its waits) is checked against the readable
// step on a machine without a GPU (tests/gpu/test_gpu.py, tests/gpu/test_fused_v2.py).
//
// Each CUDA thread of a block is a fiber (its own stack, switched by hand:
// no OS thread, so every run is the same run). A fiber runs until it reaches
// a point where it needs other threads: __syncthreads (all threads of the
// block), or a warp-level operation (all 32 lanes of its warp). Warps run one
// after another: warp 0 runs until all its lanes wait at a barrier, then warp
// 1, ...; a warp-level operation is carried out as soon as its warp's 32 lanes
// have reached it, with their registers gathered and scattered in the
// hardware's fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16",
// "ldmatrix"). So a warp never sees what another warp has not yet done: a
// missing barrier shows as data not yet written.
//
// cp.async is asynchronous here as on the GPU, at its latest: a copy is
// recorded when issued (its destination filled with 0xff bytes, a NaN in
// float16 and bfloat16), committed into the issuing thread's group, and lands
// only when that thread waits for the group (cp.async.wait_group). Reading
// shared memory without the wait, or without the barrier after it, reads the
// poison or the previous tile.
//
// Checked as it runs, and reported as an error of the launch (not a crash):
// a barrier or warp operation some threads never reach (a deadlock on the
// GPU), a warp operation reached by lanes at different operations, shared
// memory addresses out of the dynamic buffer or misaligned. Counted: bank
// conflicts of ldmatrix (the 8 rows of each 8x8 matrix should fall in 8
// different 16-byte bank groups).
//
// Floating point as CuPy compiles kernels (-ftz=true): float32 values below
// 2^-126 are flushed to zero, in and out (MXCSR FTZ and DAZ, restored after
// each launch). The 16-bit conversions and the tensor-core products are done
// with integer arithmetic and doubles, so flushing does not touch them: the
// products of 16-bit values are exact, summed in double and rounded once to
// float32.
//
//   g++ -std=c++20 -O1 -shared -fPIC -Wno-unknown-pragmas -DKERNEL_VERSION=2
//       -DHEAD_DIM=64 -DWARPS=2 -DBN=32 -DKV_BF16=0
//       -DKERNEL='"gpu_impl/steps/kernels/attend_block_v2.cu"' -o emulated.so tests/support/gpu/emulate_cuda.cpp
// (version 1: -DHEAD_DIM=16 -DTQ=64 -DTK=32 -DKV_HALF=0, KERNEL its source.)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>
#else
#include <ucontext.h>
#endif

#ifndef KERNEL_VERSION
#define KERNEL_VERSION 1
#endif

namespace emu {

struct Index3 { unsigned x = 0, y = 0, z = 0; };

// -- exact conversions of 16-bit floats (integer arithmetic: no flushing) ------------

inline uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float half_to_float(uint16_t h)
{
    const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    if (exp == 0x1f)
        return from_bits(sign | 0x7f800000u | (mant << 13));
    if (exp != 0)
        return from_bits(sign | ((exp + 112) << 23) | (mant << 13));
    if (mant == 0)
        return from_bits(sign);
    int shifts = 0;                                  // a subnormal: normalise
    while (!(mant & 0x400)) {
        mant <<= 1;
        ++shifts;
    }
    return from_bits(sign | uint32_t(113 - shifts) << 23 | ((mant & 0x3ff) << 13));
}

inline float bf16_to_float(uint16_t h) { return from_bits(uint32_t(h) << 16); }

inline uint16_t float_to_half(float value)          // round to nearest even
{
    uint32_t f = bits(value);
    const uint32_t sign = (f >> 16) & 0x8000;
    f &= 0x7fffffffu;
    if (f > 0x7f800000u)
        return uint16_t(sign | 0x7e00);              // NaN
    if (f >= 0x47800000u)                            // >= 2^16: inf
        return uint16_t(sign | 0x7c00);
    if (f < 0x38800000u) {                           // below 2^-14: a half subnormal (or 0)
        if (f < 0x33000000u)                         // <= 2^-25: 0 (2^-25 is a tie, to even)
            return uint16_t(sign);
        const uint32_t exp = f >> 23, mant = (f & 0x7fffff) | 0x800000;
        const int shift = 126 - int(exp);            // value = mant * 2^(exp - 150); half units 2^-24
        uint32_t q = mant >> shift;
        const uint32_t rest = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (q & 1)))
            ++q;
        return uint16_t(sign | q);
    }
    const uint32_t odd = (f >> 13) & 1;
    f += 0xc8000fffu + odd;                          // exponent - 112, and round
    return uint16_t(sign | (f >> 13));               // a carry into the exponent gives inf
}

inline uint16_t float_to_bf16(float value)
{
    const uint32_t f = bits(value);
    if ((f & 0x7fffffffu) > 0x7f800000u)
        return uint16_t((f >> 16) | 0x40);           // NaN, quiet
    return uint16_t((f + 0x7fffu + ((f >> 16) & 1)) >> 16);
}

// the 16-bit type of the tensor-core operands
#if KERNEL_VERSION == 2 && KV_BF16
#define KV_TO_FLOAT ::emu::bf16_to_float
#define FLOAT_TO_KV ::emu::float_to_bf16
#else
#define KV_TO_FLOAT ::emu::half_to_float
#define FLOAT_TO_KV ::emu::float_to_half
#endif

// -- fibers ------------------------------------------------------------------------

enum class At { Running, WarpOp, Barrier, Done };
enum class Op { None, Shuffle, Mma, LdMatrix, LdMatrixTrans };

struct Copy {
    void* dst;
    const void* src;
    int bytes;
    bool valid;
};

struct Fiber {
    void* sp = nullptr;                              // saved stack pointer (or context)
    std::unique_ptr<char[]> stack;
    unsigned index = 0;
    At at = At::Running;
    // what it waits at: a warp-level operation's inputs and where its result goes
    Op op = Op::None;
    int line = 0;                                    // of the kernel's source: which operation
    float value = 0.0f;
    int source = 0, predicate = 0;
    const void* in_a = nullptr;
    const void* in_b = nullptr;
    void* out = nullptr;
    // cp.async: copies issued but not committed, and committed groups in flight
    std::vector<Copy> open;
    std::deque<std::vector<Copy>> groups;
#if !defined(__x86_64__)
    ucontext_t context;
#endif
};

constexpr size_t STACK_BYTES = 512 * 1024;

Fiber* current = nullptr;
Index3 block_index;
std::function<void()> body;                          // the kernel call with its arguments
std::vector<Fiber> fibers;
std::string error;
long long bank_conflicts = 0, warp_ops = 0;
unsigned char* dynamic_smem = nullptr;
size_t dynamic_smem_bytes = 0;

#if defined(__x86_64__)
void* scheduler_sp = nullptr;
extern "C" void emu_switch(void** save, void* to);
extern "C" void emu_fiber_start();
asm(R"(
    .text
    .hidden emu_switch
    .globl emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
    .hidden emu_fiber_start
    .globl emu_fiber_start
    .type emu_fiber_start, @function
emu_fiber_start:
    call emu_fiber_main
    ud2
    .size emu_fiber_start, .-emu_fiber_start
)");
#else
ucontext_t scheduler_context;
#endif

extern "C" __attribute__((visibility("hidden"))) void emu_fiber_main()
{
    body();
    current->at = At::Done;
#if defined(__x86_64__)
    emu_switch(&current->sp, scheduler_sp);
#else
    swapcontext(&current->context, &scheduler_context);
#endif
}

#if !defined(__x86_64__)
void fiber_entry() { emu_fiber_main(); }
#endif

void start(Fiber& f)
{
    f.at = At::Running;
    f.op = Op::None;
    f.open.clear();
    f.groups.clear();
    if (!f.stack)
        f.stack.reset(new char[STACK_BYTES]);
#if defined(__x86_64__)
    // the frame emu_switch pops: r15, r14, r13, r12, rbx, rbp, then the return
    // address; after it, rsp is 16-byte aligned for the call in emu_fiber_start
    auto top = reinterpret_cast<uintptr_t>(f.stack.get() + STACK_BYTES) & ~uintptr_t(15);
    auto* frame = reinterpret_cast<void**>(top - 72);
    std::memset(frame, 0, 72);
    frame[6] = reinterpret_cast<void*>(&emu_fiber_start);
    f.sp = frame;
#else
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.get();
    f.context.uc_stack.ss_size = STACK_BYTES;
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_entry, 0);
#endif
}

void resume(Fiber& f)
{
    current = &f;
    f.at = At::Running;
#if defined(__x86_64__)
    emu_switch(&scheduler_sp, f.sp);
#else
    swapcontext(&scheduler_context, &f.context);
#endif
    current = nullptr;
}

// The running fiber stops at `at` and hands control back to the scheduler.
void block_here(At at)
{
    Fiber* f = current;
    f->at = at;
#if defined(__x86_64__)
    emu_switch(&f->sp, scheduler_sp);
#else
    swapcontext(&f->context, &scheduler_context);
#endif
}

void fail(const std::string& what)
{
    if (error.empty())
        error = what;
}

// -- shared memory checks ------------------------------------------------------------

bool in_dynamic_smem(const void* p, size_t bytes)
{
    auto* c = static_cast<const unsigned char*>(p);
    return c >= dynamic_smem && c + bytes <= dynamic_smem + dynamic_smem_bytes;
}

void check_smem(const void* p, size_t bytes, const char* what)
{
    if (!in_dynamic_smem(p, bytes))
        fail(std::string(what) + ": address outside the dynamic shared memory");
    else if (reinterpret_cast<uintptr_t>(p) % bytes != 0)
        fail(std::string(what) + ": address not aligned to its size");
}

// -- the warp-level operations, carried out once all 32 lanes have posted ------------

void mma(Fiber* lanes)
{
    // A 16x16 and B 16x8 of 16-bit values, C = D 16x8 float32 (PTX: mma.m16n8k16 .f16/.bf16)
    double A[16][16], B[16][8];
    auto to_float = [](uint16_t h) { return double(KV_TO_FLOAT(h)); };
    for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        auto* a = static_cast<const uint32_t*>(lanes[lane].in_a);
        auto* b = static_cast<const uint32_t*>(lanes[lane].in_b);
        for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i % 2), col = 2 * t + 8 * (i / 2);
            A[row][col] = to_float(uint16_t(a[i] & 0xffff));
            A[row][col + 1] = to_float(uint16_t(a[i] >> 16));
        }
        for (int i = 0; i < 2; ++i) {
            B[2 * t + 8 * i][g] = to_float(uint16_t(b[i] & 0xffff));
            B[2 * t + 8 * i + 1][g] = to_float(uint16_t(b[i] >> 16));
        }
    }
    float D[16][8];
    for (int lane = 0; lane < 32; ++lane) {         // C, from the accumulators
        const int g = lane / 4, t = lane % 4;
        auto* d = static_cast<float*>(lanes[lane].out);
        D[g][2 * t] = d[0]; D[g][2 * t + 1] = d[1]; D[g + 8][2 * t] = d[2]; D[g + 8][2 * t + 1] = d[3];
    }
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 8; ++c) {
            double sum = D[r][c];
            for (int k = 0; k < 16; ++k)
                sum += A[r][k] * B[k][c];
            D[r][c] = float(sum);
        }
    for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        auto* d = static_cast<float*>(lanes[lane].out);
        d[0] = D[g][2 * t]; d[1] = D[g][2 * t + 1]; d[2] = D[g + 8][2 * t]; d[3] = D[g + 8][2 * t + 1];
    }
}

void ldmatrix(Fiber* lanes, bool trans)
{
    // four 8x8 matrices of 16-bit values: lanes 8i .. 8i+7 give the rows of matrix i
    uint16_t M[4][8][8];
    for (int i = 0; i < 4; ++i) {
        unsigned groups = 0;
        for (int r = 0; r < 8; ++r) {
            const void* row = lanes[8 * i + r].in_a;
            check_smem(row, 16, "ldmatrix");
            if (!error.empty())
                return;
            std::memcpy(M[i][r], row, 16);
            groups |= 1u << ((static_cast<const unsigned char*>(row) - dynamic_smem) / 16 % 8);
        }
        bank_conflicts += 8 - __builtin_popcount(groups);
    }
    for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        auto* out = static_cast<uint32_t*>(lanes[lane].out);
        for (int i = 0; i < 4; ++i) {
            const uint16_t lo = trans ? M[i][2 * t][g] : M[i][g][2 * t];
            const uint16_t hi = trans ? M[i][2 * t + 1][g] : M[i][g][2 * t + 1];
            out[i] = uint32_t(lo) | uint32_t(hi) << 16;
        }
    }
}

void shuffle(Fiber* lanes)
{
    float values[32];
    for (int lane = 0; lane < 32; ++lane)
        values[lane] = lanes[lane].value;
    for (int lane = 0; lane < 32; ++lane)
        *static_cast<float*>(lanes[lane].out) = values[lanes[lane].source & 31];
}

// -- the scheduler -------------------------------------------------------------------

// Run warp w's lanes until every one waits at a barrier or is done, carrying
// out each warp-level operation once all 32 lanes have reached it.
bool run_warp(size_t w)
{
    const size_t first = 32 * w, last = std::min(fibers.size(), first + 32);
    for (;;) {
        for (size_t i = first; i < last; ++i)
            if (fibers[i].at == At::Running)
                resume(fibers[i]);
        size_t at_op = 0, done = 0;
        for (size_t i = first; i < last; ++i) {
            at_op += fibers[i].at == At::WarpOp;
            done += fibers[i].at == At::Done;
        }
        if (at_op == 0)
            return true;
        if (at_op != 32) {
            fail("warp " + std::to_string(w) + ": a warp-level operation reached by " + std::to_string(at_op) +
                 " lanes; the others " + (done ? "have exited" : "wait at a barrier"));
            return false;
        }
        Fiber* lanes = &fibers[first];
        for (int lane = 1; lane < 32; ++lane)
            if (lanes[lane].op != lanes[0].op || lanes[lane].line != lanes[0].line) {
                fail("warp " + std::to_string(w) + ": lanes at different warp-level operations (lines " +
                     std::to_string(lanes[0].line) + " and " + std::to_string(lanes[lane].line) + ")");
                return false;
            }
        ++warp_ops;
        switch (lanes[0].op) {
        case Op::Shuffle: shuffle(lanes); break;
        case Op::Mma: mma(lanes); break;
        case Op::LdMatrix: ldmatrix(lanes, false); break;
        case Op::LdMatrixTrans: ldmatrix(lanes, true); break;
        case Op::None: break;
        }
        if (!error.empty())
            return false;
        for (int lane = 0; lane < 32; ++lane)
            lanes[lane].at = At::Running;
    }
}

// One block: warps in turn up to the next barrier, then the barrier.
bool run_block()
{
    for (;;) {
        for (size_t w = 0; w * 32 < fibers.size(); ++w)
            if (!run_warp(w))
                return false;
        size_t waiting = 0;
        int any = 0;
        for (auto& f : fibers)
            if (f.at == At::Barrier) {
                ++waiting;
                any |= f.predicate;
            }
        if (waiting == 0)
            return true;                             // every thread is done
        for (auto& f : fibers)
            if (f.at == At::Barrier) {
                if (f.out)
                    *static_cast<int*>(f.out) = any;
                f.at = At::Running;
            }
    }
}

class FlushToZero {                                  // CuPy's -ftz=true, for one launch
public:
    FlushToZero()
    {
#if defined(__x86_64__)
        saved_ = _mm_getcsr();
        _mm_setcsr(saved_ | 0x8040);                 // FTZ (bit 15) and DAZ (bit 6)
#elif defined(__aarch64__)
        asm volatile("mrs %0, fpcr" : "=r"(saved_));
        asm volatile("msr fpcr, %0" :: "r"(saved_ | (uint64_t(1) << 24)));
#endif
    }
    ~FlushToZero()
    {
#if defined(__x86_64__)
        _mm_setcsr(saved_);
#elif defined(__aarch64__)
        asm volatile("msr fpcr, %0" :: "r"(saved_));
#endif
    }

private:
#if defined(__x86_64__)
    unsigned saved_;
#else
    uint64_t saved_ = 0;
#endif
};

bool flush_to_zero = true;

// The kernel call `kernel_body` on every block of the grid, `threads` threads each.
int launch(Index3 grid, unsigned threads, size_t smem_bytes, std::function<void()> kernel_body)
{
    std::unique_ptr<FlushToZero> ftz(flush_to_zero ? new FlushToZero : nullptr);
    error.clear();
    std::vector<unsigned char> smem(smem_bytes + 16);
    dynamic_smem = smem.data() + (16 - reinterpret_cast<uintptr_t>(smem.data()) % 16) % 16;
    dynamic_smem_bytes = smem_bytes;
    body = std::move(kernel_body);
    fibers = std::vector<Fiber>(threads);           // their stacks serve every block
    for (unsigned z = 0; z < grid.z && error.empty(); ++z)
        for (unsigned y = 0; y < grid.y && error.empty(); ++y)
            for (unsigned x = 0; x < grid.x && error.empty(); ++x) {
                block_index = {x, y, z};
                std::memset(dynamic_smem, 0xff, smem_bytes);      // uninitialised: NaN as 16-bit values
                for (unsigned t = 0; t < threads; ++t) {
                    fibers[t].index = t;
                    start(fibers[t]);
                }
                if (!run_block() && error.empty())
                    fail("block did not finish");
                if (!error.empty())
                    error = "block (" + std::to_string(x) + ", " + std::to_string(y) + ", " +
                            std::to_string(z) + "): " + error;
            }
    fibers.clear();                                  // a failed block's fibers are dropped, not finished
    dynamic_smem = nullptr;
    return error.empty() ? 0 : -1;
}

// -- what the kernel calls ---------------------------------------------------------------

void post(Op op, int line)
{
    current->op = op;
    current->line = line;
    block_here(At::WarpOp);
}

}  // namespace emu

// CUDA's names, as the kernels use them
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define threadIdx (::emu::Index3{::emu::current->index, 0, 0})
#define blockIdx (::emu::block_index)
#define EMULATED 1
#define DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(::emu::dynamic_smem)

struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float __int_as_float(int i) { return emu::from_bits(uint32_t(i)); }
using std::max;
using std::min;

inline void __syncthreads()
{
    emu::current->out = nullptr;
    emu::current->predicate = 0;
    emu::block_here(emu::At::Barrier);
}

inline int __syncthreads_or(int predicate)
{
    int result = 0;
    emu::current->out = &result;
    emu::current->predicate = predicate != 0;
    emu::block_here(emu::At::Barrier);
    return result;
}

// The warp-level operations take the line of the kernel's source they are
// called from, so that lanes at different operations are told apart.
inline float emu_shfl(float value, int source, int line)
{
    float result;
    emu::current->value = value;
    emu::current->source = source;
    emu::current->out = &result;
    emu::post(emu::Op::Shuffle, line);
    return result;
}
#define __shfl_sync(mask, value, source) emu_shfl(value, source, __LINE__)
#define __shfl_xor_sync(mask, value, lane_mask) emu_shfl(value, int(::emu::current->index % 32) ^ (lane_mask), __LINE__)

inline void emu_mma(float d[4], const unsigned a[4], const unsigned b[2], int line)
{
    emu::current->in_a = a;
    emu::current->in_b = b;
    emu::current->out = d;
    emu::post(emu::Op::Mma, line);
}
#define mma_m16n8k16(d, a, b) emu_mma(d, a, b, __LINE__)

inline void emu_ldmatrix(unsigned r[4], const void* row, bool trans, int line)
{
    emu::current->in_a = row;
    emu::current->out = r;
    emu::post(trans ? emu::Op::LdMatrixTrans : emu::Op::LdMatrix, line);
}
#define ldmatrix_x4(r, row) emu_ldmatrix(r, row, false, __LINE__)
#define ldmatrix_x4_trans(r, row) emu_ldmatrix(r, row, true, __LINE__)

inline void cp_async(void* dst, const void* src, int bytes, bool valid)
{
    emu::check_smem(dst, bytes, "cp.async destination");
    if (valid && reinterpret_cast<uintptr_t>(src) % bytes != 0)
        emu::fail("cp.async: source not aligned to its size");
    if (!emu::error.empty())
        return;
    std::memset(dst, 0xff, bytes);                   // in flight: not there yet
    emu::current->open.push_back({dst, src, bytes, valid});
}

inline void cp_async_16(void* dst, const void* src, bool valid) { cp_async(dst, src, 16, valid); }
inline void cp_async_4(void* dst, const void* src, bool valid) { cp_async(dst, src, 4, valid); }

inline void cp_async_commit()
{
    auto* f = emu::current;
    f->groups.push_back(std::move(f->open));
    f->open.clear();
}

template <int N>
inline void cp_async_wait()
{
    auto* f = emu::current;
    while (f->groups.size() > size_t(N)) {           // the oldest groups land
        for (const auto& copy : f->groups.front()) {
            if (copy.valid)
                std::memcpy(copy.dst, copy.src, copy.bytes);
            else
                std::memset(copy.dst, 0, copy.bytes);
        }
        f->groups.pop_front();
    }
}

inline unsigned pack_16x2(float lo, float hi) { return FLOAT_TO_KV(lo) | unsigned(FLOAT_TO_KV(hi)) << 16; }
inline float from_16(unsigned short h) { return KV_TO_FLOAT(h); }
#define HALF_TO_FLOAT ::emu::half_to_float           // version 1's float16 blocks

#include KERNEL

extern "C" {

const char* emu_last_error() { return emu::error.c_str(); }
long long emu_bank_conflicts() { return emu::bank_conflicts; }
long long emu_warp_ops() { return emu::warp_ops; }
void emu_reset_counters() { emu::bank_conflicts = emu::warp_ops = 0; }
void emu_flush_to_zero(int on) { emu::flush_to_zero = on != 0; }
unsigned emu_pack_16x2(float lo, float hi) { return pack_16x2(lo, hi); }
float emu_from_16(unsigned short h) { return from_16(h); }

#if KERNEL_VERSION == 1
// attend_block_v1 on a (gx, gy, gz) grid of TQ threads per block.
int launch_attend_block_v1(int gx, int gy, int gz, const float* q, const kv_t* k, const kv_t* v,
                           const long long* q_pos, const long long* k_pos, float* o, float* m, float* l, int c,
                           int ck, int G, int causal)
{
    return emu::launch({unsigned(gx), unsigned(gy), unsigned(gz)}, TQ, 0,
                       [=] { attend_block_v1(q, k, v, q_pos, k_pos, o, m, l, c, ck, G, causal); });
}
#else
// attend_block_v2 on a (gx, gy) grid of 32 * WARPS threads per block.
int launch_attend_block_v2(int gx, int gy, int smem_bytes, const float* q, const kv_t* k, const kv_t* v,
                           const int* k_pos, const int* q_lo, const int* q_hi, const int* q_doc, const int* k_doc,
                           const signed char* kinds, float* o, float* m, float* l, int c, int ck, int G, int tq,
                           int has_docs, float unscale, float rescale)
{
    return emu::launch({unsigned(gx), unsigned(gy), 1}, THREADS, size_t(smem_bytes), [=] {
        attend_block_v2(q, k, v, k_pos, q_lo, q_hi, q_doc, k_doc, kinds, o, m, l, c, ck, G, tq, has_docs,
                        unscale, rescale);
    });
}

// The backward's two kernels: dK, dV on a (key tiles, B * Hkv) grid of 2 * BN
// threads per block; dQ on a (query tiles, B * Hkv) grid of 32 * WARPS.
int launch_attend_block_v2_dkdv(int gx, int gy, int smem_bytes, const float* q, const float* d_o, const float* lse,
                                const float* delta, const kv_t* k, const kv_t* v, const int* k_pos, const int* q_lo,
                                const int* q_hi, const int* q_doc, const int* k_doc, const signed char* kinds,
                                float* dk, float* dv, int c, int ck, int G, int tq, int has_docs, float unscale,
                                float rescale)
{
    return emu::launch({unsigned(gx), unsigned(gy), 1}, KV_THREADS, size_t(smem_bytes), [=] {
        attend_block_v2_dkdv(q, d_o, lse, delta, k, v, k_pos, q_lo, q_hi, q_doc, k_doc, kinds, dk, dv, c, ck, G,
                             tq, has_docs, unscale, rescale);
    });
}

int launch_attend_block_v2_dq(int gx, int gy, int smem_bytes, const float* q, const float* d_o, const float* lse,
                              const float* delta, const kv_t* k, const kv_t* v, const int* k_pos, const int* q_lo,
                              const int* q_hi, const int* q_doc, const int* k_doc, const signed char* kinds,
                              float* dq, int c, int ck, int G, int tq, int has_docs, float unscale, float rescale)
{
    return emu::launch({unsigned(gx), unsigned(gy), 1}, THREADS, size_t(smem_bytes), [=] {
        attend_block_v2_dq(q, d_o, lse, delta, k, v, k_pos, q_lo, q_hi, q_doc, k_doc, kinds, dq, c, ck, G, tq,
                           has_docs, unscale, rescale);
    });
}
#endif
}
