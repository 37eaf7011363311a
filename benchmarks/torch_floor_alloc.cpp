// The floor of issue 30's `generate` target (benchmarks/bench_torch_alloc.py --floor): the cheapest
// honest allocator that PyTorch's pluggable interface (torch.cuda.memory.CUDAPluggableAllocator,
// the path poollab's trampoline is installed through) can call. Exact-size free lists of
// 512-byte-rounded blocks over cudaMalloc, one mutex, no Python, no GIL, no clock reads: what is
// left of a policy's cost over PyTorch's own allocator is PyTorch's pluggable path itself (its
// own pointer map and lock on every call) plus a hash lookup.
//
// Not an allocator to use: it never gives memory back before the process ends, and a block freed
// on one stream is reused on any (the benchmark's `generate` runs on one stream). Built by the
// benchmark with the host's C++ compiler; needs no CUDA headers (cudaMalloc and cudaFree come in
// as addresses from the runtime PyTorch loaded: realgpu.torch_allocator.cudart_address).
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {
typedef int (*cuda_malloc_fn)(void**, size_t);
typedef int (*cuda_free_fn)(void*);
cuda_malloc_fn g_cuda_malloc = nullptr;
cuda_free_fn g_cuda_free = nullptr;
std::mutex g_lock;
// an unordered_map keyed by rounded size: one hash a call, and the sizes of a model's steady
// state are a few hundred distinct values
std::unordered_map<size_t, std::vector<void*>> g_free_blocks;
uint64_t g_num_malloc = 0, g_num_driver_malloc = 0, g_num_free = 0;
uint64_t g_held_bytes = 0;

inline size_t rounded(ssize_t size) { return (size_t(size) + 511) & ~size_t(511); }
}  // namespace

extern "C" {
void floor_set_driver(void* cuda_malloc, void* cuda_free) {
  g_cuda_malloc = reinterpret_cast<cuda_malloc_fn>(cuda_malloc);
  g_cuda_free = reinterpret_cast<cuda_free_fn>(cuda_free);
}

void* floor_malloc(ssize_t size, int device, void* stream) {
  (void)device;
  (void)stream;
  if (size <= 0) return nullptr;
  size_t key = rounded(size);
  {
    std::lock_guard<std::mutex> hold(g_lock);
    ++g_num_malloc;
    auto it = g_free_blocks.find(key);
    if (it != g_free_blocks.end() && !it->second.empty()) {
      void* ptr = it->second.back();
      it->second.pop_back();
      return ptr;
    }
    ++g_num_driver_malloc;
  }
  void* ptr = nullptr;
  if (g_cuda_malloc == nullptr || g_cuda_malloc(&ptr, key) != 0) return nullptr;  // PyTorch: OOM
  std::lock_guard<std::mutex> hold(g_lock);
  g_held_bytes += key;
  return ptr;
}

void floor_free(void* ptr, ssize_t size, int device, void* stream) {
  (void)device;
  (void)stream;
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> hold(g_lock);
  ++g_num_free;
  g_free_blocks[rounded(size)].push_back(ptr);
}

// counters for the benchmark's report: calls, calls that reached cudaMalloc, frees, bytes held
void floor_counters(uint64_t* out) {
  std::lock_guard<std::mutex> hold(g_lock);
  out[0] = g_num_malloc;
  out[1] = g_num_driver_malloc;
  out[2] = g_num_free;
  out[3] = g_held_bytes;
}
}
