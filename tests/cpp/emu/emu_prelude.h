// A CPU emulator for the CUDA kernels of csrc/cuda, so their indexing, fragment layouts,
// masking and synchronization are executed and checked on a machine without a GPU. Force-
// included (g++ -include) before a kernel file whose `kernel<<<...>>>(args)` launches and
// `extern __shared__` declaration tests/test_cuda_backend.py has rewritten into emu:: calls;
// emu/cuda/mma.cuh stands in for csrc/cuda/mma.cuh (it comes first on the include path).
//
// Model: the blocks of a grid run one after another; every thread of a block is a fiber with
// its own stack, and fibers switch only at synchronization points: __syncthreads (all threads
// of the block) and the warp-collective operations (shuffles and, in emu/cuda/mma.cuh,
// ldmatrix and mma), evaluated once all 32 lanes have arrived, like the hardware's .sync
// instructions. The next fiber to run is drawn at random (seeded by EMU_SEED), so results that
// depend on a missing barrier vary between seeds. Shared memory starts filled with 0xff bytes
// (NaN in every float format), so reads of unwritten smem show up as NaN in the results.
// cp.async copies land at the issue (EMU_CP_ASYNC=eager, the default) or at the issuing
// thread's wait (lazy), to expose both orders. Not modelled: memory-model subtleties beyond
// barriers, timing, and the hardware's summation order inside mma (exact products, fp32 sums
// here). Removing either __syncthreads of the forward's key loop, or the one before the
// backward's dQ, makes tests/test_cuda_backend.py fail.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#define __launch_bounds__(...)

namespace emu {

struct Copy16 {
  void* dst;
  const void* src;
  bool valid;
};

// Stack switch (weak: every translation unit carries a copy): saves the callee-saved registers
// on the current stack, stores the stack pointer in *save_sp and resumes the context whose stack
// pointer is new_sp (a switch costs a few ns; ucontext's swapcontext makes two syscalls).
extern "C" void emu_switch(void** save_sp, void* new_sp);
#if defined(__x86_64__)
asm(R"(
.text
.weak emu_switch
.type emu_switch,@function
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
)");
#else
#error "the emulator's stack switch is written for x86-64"
#endif

constexpr size_t kStackBytes = 1 << 18;

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;  // kStackBytes, from a pool reused by every block
  uint3 tid;
  bool done = false;
  bool waiting = false;
  std::vector<Copy16> pending;  // lazy cp.async
};

constexpr int kMaxWords = 16;

struct Warp {
  int arrived = 0;
  int kind = -1;
  uint32_t in[32][kMaxWords];
  uint32_t out[32][kMaxWords];
};

struct Block {
  dim3 grid, dim;
  uint3 idx;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<int> ready;  // fibers that can run
  int live = 0, cur = -1;
  void* sched_sp = nullptr;
  int bar_arrived = 0;
  std::vector<unsigned char> smem;
  std::function<void()> entry;
};

inline Block* g_block = nullptr;
inline std::mt19937_64 g_rng(getenv("EMU_SEED") ? strtoull(getenv("EMU_SEED"), nullptr, 10) : 1);
inline bool g_lazy_copies = [] {
  const char* m = getenv("EMU_CP_ASYNC");
  return m != nullptr && strcmp(m, "lazy") == 0;
}();

[[noreturn]] inline void fail(const char* what) {
  fprintf(stderr, "emu: %s (block %u,%u,%u thread %d)\n", what, g_block->idx.x, g_block->idx.y,
          g_block->idx.z, g_block->cur);
  exit(3);
}

inline Fiber& self() { return g_block->fibers[g_block->cur]; }
inline int linear_tid() { return g_block->cur; }
inline uint3 thread_idx() { return self().tid; }

// Park the running fiber until wake() makes it ready again.
inline void park() {
  Fiber& f = self();
  f.waiting = true;
  emu_switch(&f.sp, g_block->sched_sp);
}

inline void wake(int fiber) {
  if (g_block->fibers[fiber].waiting) {
    g_block->fibers[fiber].waiting = false;
    g_block->ready.push_back(fiber);
  }
}

inline void fiber_main() {
  g_block->entry();
  if (!self().pending.empty()) fail("thread exited with cp.async copies not waited for");
  self().done = true;
  if (--g_block->live > 0 && g_block->bar_arrived == g_block->live) {  // exited threads do not
    g_block->bar_arrived = 0;                                          // hold up a barrier
    for (size_t i = 0; i < g_block->fibers.size(); ++i) wake(static_cast<int>(i));
  }
  void* dead_sp;
  emu_switch(&dead_sp, g_block->sched_sp);
}

inline void run_block(const dim3& grid, const dim3& dim, uint3 idx, size_t smem_bytes,
                      std::function<void()> entry) {
  Block blk;
  blk.grid = grid;
  blk.dim = dim;
  blk.idx = idx;
  blk.entry = std::move(entry);
  blk.smem.assign(smem_bytes + 16, 0xff);
  const int n = static_cast<int>(dim.x * dim.y * dim.z);
  if (n % 32 != 0) fail("block size must be a multiple of 32");
  blk.fibers.resize(n);
  blk.warps.resize(n / 32);
  blk.live = n;
  g_block = &blk;
  static std::vector<std::unique_ptr<char[]>> stacks;
  while (static_cast<int>(stacks.size()) < n) stacks.emplace_back(new char[kStackBytes]);
  for (int i = 0; i < n; ++i) {
    Fiber& f = blk.fibers[i];
    f.tid = {static_cast<unsigned>(i % dim.x), static_cast<unsigned>(i / dim.x % dim.y),
             static_cast<unsigned>(i / (dim.x * dim.y))};
    f.stack = stacks[i].get();
    // initial frame for emu_switch: 6 saved registers, then fiber_main as the return address
    const uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack) + kStackBytes) & ~uintptr_t(15);
    void** frame = reinterpret_cast<void**>(top - 64);
    for (int r = 0; r < 6; ++r) frame[r] = nullptr;
    frame[6] = reinterpret_cast<void*>(&fiber_main);
    f.sp = frame;
    blk.ready.push_back(i);
  }
  while (blk.live > 0) {
    if (blk.ready.empty()) fail("deadlock: every live thread waits at a barrier");
    const size_t pick = g_rng() % blk.ready.size();
    blk.cur = blk.ready[pick];
    blk.ready[pick] = blk.ready.back();
    blk.ready.pop_back();
    emu_switch(&blk.sched_sp, blk.fibers[blk.cur].sp);
  }
  g_block = nullptr;
}

template <typename... KArgs, typename... Args>
cudaError_t launch(void (*kernel)(KArgs...), dim3 grid, dim3 dim, size_t smem_bytes, cudaStream_t,
                   const Args&... args) {
  const std::tuple<Args...> params(args...);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x)
        run_block(grid, dim, {x, y, z}, smem_bytes, [&] { std::apply(kernel, params); });
  return cudaSuccess;
}

inline unsigned char* dynamic_smem() { return g_block->smem.data(); }

inline void check_smem(const void* p, size_t bytes, const char* what) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  if (c < g_block->smem.data() || c + bytes > g_block->smem.data() + g_block->smem.size() - 16)
    fail(what);
}

inline void syncthreads() {
  Block& b = *g_block;
  if (++b.bar_arrived == b.live) {
    b.bar_arrived = 0;
    for (size_t i = 0; i < b.fibers.size(); ++i) wake(static_cast<int>(i));
    return;
  }
  park();
}

// Warp collective: each lane deposits `in` words; the last lane to arrive runs
// compute(in, out) for all 32 lanes; every lane then gets out[lane].
template <typename F>
inline const uint32_t* warp_collective(int kind, const uint32_t* in, int words, F&& compute) {
  Warp& w = g_block->warps[linear_tid() / 32];
  const int lane = linear_tid() % 32;
  if (w.arrived == 0) w.kind = kind;
  if (w.kind != kind) fail("lanes of a warp are in different collective operations");
  memcpy(w.in[lane], in, sizeof(uint32_t) * words);
  if (++w.arrived == 32) {
    compute(w.in, w.out);
    w.arrived = 0;
    const int first = linear_tid() / 32 * 32;
    for (int l = 0; l < 32; ++l) wake(first + l);
  } else {
    park();
  }
  return w.out[lane];
}

template <typename V>
__attribute__((noinline)) V shfl_xor(V v, int lane_mask) {
  static_assert(sizeof(V) == 4, "32-bit shuffles only");
  uint32_t word;
  memcpy(&word, &v, 4);
  const uint32_t* r = warp_collective(
      0, &word, 1, [&](uint32_t (&in)[32][kMaxWords], uint32_t (&out)[32][kMaxWords]) {
        for (int l = 0; l < 32; ++l) out[l][0] = in[l ^ lane_mask][0];
      });
  V res;
  memcpy(&res, r, 4);
  return res;
}

inline void do_copy(const Copy16& c) {
  if (c.valid)
    memcpy(c.dst, c.src, 16);
  else
    memset(c.dst, 0, 16);
}

inline void cp_async_16(void* dst, const void* src, bool valid) {
  check_smem(dst, 16, "cp.async destination outside shared memory");
  if (reinterpret_cast<uintptr_t>(dst) % 16 || (valid && reinterpret_cast<uintptr_t>(src) % 16))
    fail("cp.async address not 16-byte aligned");
  if (g_lazy_copies)
    self().pending.push_back({dst, src, valid});
  else
    do_copy({dst, src, valid});
}

inline void cp_async_wait_all() {
  for (const Copy16& c : self().pending) do_copy(c);
  self().pending.clear();
}

}  // namespace emu

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::g_block->idx)
#define blockDim (::emu::g_block->dim)
#define gridDim (::emu::g_block->grid)
#define __syncthreads() ::emu::syncthreads()
#define cudaFuncSetAttribute(...) cudaSuccess
#define cudaGetLastError() cudaSuccess
#define cudaMemsetAsync(ptr, value, bytes, stream) (memset((ptr), (value), (bytes)), cudaSuccess)

template <typename V>
inline V __shfl_xor_sync(unsigned, V v, int lane_mask) {
  return ::emu::shfl_xor(v, lane_mask);
}
inline float atomicAdd(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}
using std::max;
using std::min;
